#!/usr/bin/python3
"""Fuzzes dtrain's file inputs and its signal handling against a given binary (the ASan build).

    tools/fuzz/files.py --dtrain build-asan/dtrain --seconds 120 --seed 1 --out /tmp/fuzz

Cases, each run with a timeout, within --seconds (the fixed ones first come interleaved with the
random ones; a short budget runs some of the fixed ones and says how many). With
--min-checkpoints N it goes on past --seconds, up to --max-seconds, until N corrupted checkpoints
and every data-file case have run (then without signal cases, the slow ones), and says whether
it got there:
  data     every mutation of the IDX and HDF5 data files in a fixed list (truncations, bit flips,
           wrong and huge dimensions, NaN and infinite values, labels out of range, an empty test
           split, special files); with them, in the same list, `dtrain plot` of a run whose
           metrics.jsonl is empty, blank, a special file or holds records dtrain never writes
           (epochs of 2^63-1, -5, 1.5, a loss of inf), and `tools/to_hdf5 csv` (and npy) of
           features holding NaN or infinity
  ckpt     corrupted checkpoints, drawn at random until the time is up: bit flips in every region
           (seal, superblock, metadata, data), truncations, /state values, datasets and the
           optimizer's update count rewritten with h5py with their checksums and the seal
           recomputed, weights and optimizer slots holding NaN or infinity under valid checksums;
           each one through `dtrain eval` and `dtrain resume`
  manifest the checkpoint manifest empty, garbage, reversed, repeated, deleted, a FIFO
  signal    SIGTERM/SIGINT (single and double) at random moments of a run, and under mpirun -n 2
           (SIGUSR1, SIGTERM) when mpirun is installed
  recovery  a parameter-server job (chief, 1 server, 2 workers) under tools/dtrain-mpirun
           --enable-recovery, one rank killed (SIGKILL) at a random step: a worker is survived
           (exit 0, the final checkpoint written), a lost server ends the job with exit 5, a lost
           chief with exit 1 and dtrain-mpirun's line; never 0 for a job that did not finish, never
           a hang, and every checkpoint written evaluates
Every outcome must be exit 0, or exit 2/3 with one line naming the file (`dtrain: error:`, or
`tools/to_hdf5:` for the converter) (4, or 128 + the signal
for a second signal, in the signal cases, with no *.tmp-* file left behind); never a signal death,
an abort, a sanitizer report, exit 1 or a hang. The one exception is SIGTERM/SIGINT to mpirun,
which returns 1 whatever its ranks do (docs/multi_worker.md, "Signals under mpirun"). Prints a summary
(also OUT/summary.json); exits 1 on any bad outcome, with a reproducer (the files, the command and
its output) saved under OUT/bad-N, 3 when a --min-checkpoints target was not reached in time.
"""
import argparse
import json
import os
import random
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
import zlib

import h5py
import numpy as np


def descendants(pid):
    """The PIDs of every process below `pid` (children, their children, ...), read from /proc."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as f:
                # pid (comm) state ppid ...: comm may hold spaces and parentheses.
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found

SEAL_BYTES = 512
TIMEOUT = 60
SANITIZER_MARKS = ("AddressSanitizer", "LeakSanitizer", "UndefinedBehaviorSanitizer", "runtime error:", "ERROR: ")


def flip(path, offset, mask):
    """XORs the byte at `offset` of `path` with `mask`."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def writing(data, mode):
    """A mutation writing `data` at the start of the file (mode "r+b") or as its whole text ("w")."""
    def mutate(path):
        with open(path, mode) as f:
            f.write(data)
    return mutate


def replacing(kind):
    """A mutation replacing the file by a special file, a directory, an empty file or a dangling link."""
    def mutate(path):
        os.remove(path)
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "dir":
            os.mkdir(path)
        elif kind in ("devnull", "devzero"):
            os.symlink("/dev/" + kind[3:], path)
        elif kind == "empty":
            open(path, "w").close()
        elif kind == "dangling":
            os.symlink(path + ".absent", path)
    return mutate


class Harness:
    def __init__(self, args):
        self.dtrain = os.path.abspath(args.dtrain)
        self.out = os.path.abspath(args.out)
        self.rng = random.Random(args.seed)
        self.started = time.monotonic()
        self.deadline = self.started + args.seconds
        # Past --seconds only to reach the targets, and never past --max-seconds.
        self.cap = self.started + max(args.seconds, args.max_seconds or 0)
        self.min_checkpoints = args.min_checkpoints
        self.checkpoints = 0  # corrupted checkpoints tried, each through eval and resume
        self.work = os.path.join(self.out, "work")
        shutil.rmtree(self.work, ignore_errors=True)
        os.makedirs(self.work)
        self.counts = {}
        self.bad = []
        self.env = dict(os.environ)
        self.env.setdefault("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=1")
        self.env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
        supp = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "lsan.supp")
        if os.path.exists(supp):
            self.env.setdefault("LSAN_OPTIONS", "suppressions=" + os.path.abspath(supp))
        self.env.setdefault("OMP_NUM_THREADS", "1")
        self.env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
        self.env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"

    def time_left(self):
        return self.deadline - time.monotonic()

    def targets_met(self):
        return not self.fixed and self.checkpoints >= self.min_checkpoints

    def going_on(self):
        """Whether to start another round: within --seconds, or after it while a target is unmet
        and the cap is not reached."""
        now = time.monotonic()
        return now < self.deadline or (not self.targets_met() and now < self.cap)

    # ------------------------------------------------------------------ running and judging

    def run(self, argv, timeout=TIMEOUT, cwd=None):
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=self.env, cwd=cwd or self.work,
                               errors="replace", stdin=subprocess.DEVNULL)
            return p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            return None, out, err

    def judge(self, kind, name, argv, rc, out, err, names=(), allowed=(0, 2, 3), files=(), prefix="dtrain: error:"):
        """Records one outcome; returns True when it is acceptable. `prefix` starts the one error
        line an exit 2 or 3 must print."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        problem = None
        if rc is None:
            problem = "hang (timeout)"
        elif rc < 0:
            problem = "killed by signal %d" % -rc
        elif any(mark in err for mark in SANITIZER_MARKS):
            problem = "sanitizer report"
        elif rc not in allowed:
            problem = "exit %d" % rc
        elif rc in (2, 3):
            lines = [l for l in err.splitlines() if l.startswith(prefix)]
            if len(lines) != 1:
                problem = "exit %d without exactly one '%s' line" % (rc, prefix)
            elif names and not any(n in lines[0] for n in names):
                problem = "exit %d: the error does not name %s" % (rc, " or ".join(names))
        if problem:
            self.save_bad(kind, name, argv, rc, out, err, problem, files)
            return False
        return True

    def save_bad(self, kind, name, argv, rc, out, err, problem, files):
        d = os.path.join(self.out, "bad-%d" % (len(self.bad) + 1))
        os.makedirs(d, exist_ok=True)
        for f in files:
            if os.path.isfile(f) and not os.path.islink(f):
                shutil.copy(f, d)
            elif os.path.isdir(f):
                shutil.copytree(f, os.path.join(d, os.path.basename(f)), dirs_exist_ok=True, ignore_dangling_symlinks=True,
                                ignore=lambda _d, names: [n for n in names if not os.path.isfile(os.path.join(_d, n))
                                                          and not os.path.isdir(os.path.join(_d, n))])
        with open(os.path.join(d, "case.txt"), "w") as f:
            f.write("%s %s: %s\ncommand: %s\nexit: %s\n--- stdout\n%s\n--- stderr\n%s\n"
                    % (kind, name, problem, " ".join(argv), rc, out[-4000:], err[-8000:]))
        self.bad.append("%s %s: %s (%s)" % (kind, name, problem, d))
        print("BAD %s %s: %s -> %s" % (kind, name, problem, d), flush=True)

    # ------------------------------------------------------------------ data files

    def write_idx(self, path, array, code=0x08):
        dtype = {0x08: ">u1", 0x0D: ">f4"}[code]
        with open(path, "wb") as f:
            f.write(bytes([0, 0, code, array.ndim]))
            for d in array.shape:
                f.write(struct.pack(">I", d))
            f.write(array.astype(dtype).tobytes())

    def make_idx_dir(self, path, images_code=0x08):
        os.makedirs(path, exist_ok=True)
        rng = np.random.default_rng(7)
        for prefix, n in (("train", 64), ("t10k", 16)):
            x = rng.integers(0, 255, size=(n, 8, 8))
            if images_code == 0x0D:
                x = x / 255.0
            self.write_idx(os.path.join(path, prefix + "-images-idx3-ubyte"), x, images_code)
            self.write_idx(os.path.join(path, prefix + "-labels-idx1-ubyte"), rng.integers(0, 10, size=n))

    def make_h5(self, path):
        rng = np.random.default_rng(8)
        with h5py.File(path, "w") as f:
            for group, n in (("train", 64), ("test", 16)):
                f.create_dataset(group + "/x", data=rng.random((n, 8, 8, 1), dtype=np.float32))
                f.create_dataset(group + "/y", data=rng.integers(0, 10, size=n).astype(np.int32))

    def experiment(self, path, source, data_path, extra=""):
        with open(path, "w") as f:
            f.write("""name: fuzz
seed: 1
strategy: {kind: default}
data: {source: %s, path: '%s', batch_size_per_replica: 16, shuffle_buffer: 64}
model:
  input_shape: [8, 8, 1]
  layers:
    - flatten: {}
    - dense: {units: 10}
loss: {kind: sparse_categorical_crossentropy, from_logits: true, reduction: none}
optimizer: {kind: adam, learning_rate: 0.01}
metrics: [sparse_categorical_accuracy]
train: {epochs: 2, threads: 1, progress: none}
%s""" % (source, data_path, extra))

    def data_case(self, name, source, data_path, target, files):
        exp = os.path.join(self.work, "data-%s.yaml" % name)
        self.experiment(exp, source, data_path)
        run_dir = os.path.join(self.work, "data-run-" + name)
        shutil.rmtree(run_dir, ignore_errors=True)
        argv = [self.dtrain, "run", exp, "--run-dir", run_dir]
        rc, out, err = self.run(argv)
        self.judge("data", name, argv, rc, out, err, names=(os.path.basename(target),), files=files + [exp])

    def idx_cases(self):
        base = os.path.join(self.work, "idx-good")
        self.make_idx_dir(base)
        images = "train-images-idx3-ubyte"
        labels = "train-labels-idx1-ubyte"
        size = os.path.getsize(os.path.join(base, images))

        def variant(name, which, mutate):
            def case():
                d = os.path.join(self.work, "idx-" + name)
                shutil.rmtree(d, ignore_errors=True)
                shutil.copytree(base, d)
                target = os.path.join(d, which)
                mutate(target)
                self.data_case("idx-" + name, "idx", d, target, [d])
                shutil.rmtree(d, ignore_errors=True)
            self.fixed.append(case)

        def truncate(n):
            return lambda p: os.truncate(p, n)

        def header(data):
            return writing(data, "r+b")

        def labels_out_of_range(p):
            arr = np.full(64, 3)
            arr[37] = 200
            self.write_idx(p, arr)

        def nan_images(p):
            x = np.random.default_rng(1).random((64, 8, 8))
            x[21, 3, 4] = np.nan
            self.write_idx(p, x, 0x0D)

        def inf_images(p):
            x = np.random.default_rng(1).random((64, 8, 8))
            x[5, 0, 0] = np.inf
            self.write_idx(p, x, 0x0D)

        for n in (0, 1, 3, 4, 7, 8, 15, 16, size // 2, size - 1):
            variant("trunc%d" % n, images, truncate(n))
        variant("labels-trunc", labels, truncate(9))
        for offset in (0, 1, 2, 3, 4, 7, 8, 11, 12, 15):
            for bit in (0, 7):
                variant("flip%d-%d" % (offset, bit), images, lambda p, o=offset, b=bit: flip(p, o, 1 << b))
        variant("dims-huge", images, header(bytes([0, 0, 8, 3]) + struct.pack(">III", 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF)))
        variant("dims-wrong", images, header(bytes([0, 0, 8, 3]) + struct.pack(">III", 64, 4, 16)))
        variant("dims-zero", images, header(bytes([0, 0, 8, 3]) + struct.pack(">III", 0, 8, 8)))
        variant("rank9", images, header(bytes([0, 0, 8, 9])))
        variant("labels-range", labels, labels_out_of_range)
        variant("nan", images, nan_images)
        variant("inf", images, inf_images)
        variant("trailing", images, lambda p: open(p, "ab").write(b"x"))
        for kind in ("fifo", "dir", "devnull", "devzero", "empty", "dangling"):
            variant(kind, images, replacing(kind))
            variant("labels-" + kind, labels, replacing(kind))

    def hdf5_cases(self):
        good = os.path.join(self.work, "good.h5")
        self.make_h5(good)
        size = os.path.getsize(good)

        def variant(name, mutate):
            def case():
                path = os.path.join(self.work, "h5-%s.h5" % name)
                if os.path.lexists(path):
                    if os.path.isdir(path) and not os.path.islink(path):
                        shutil.rmtree(path)
                    else:
                        os.remove(path)
                shutil.copy(good, path)
                mutate(path)
                self.data_case("h5-" + name, "hdf5", path, path, [path])
            self.fixed.append(case)

        def edit(fn):
            def f(p):
                with h5py.File(p, "r+") as h:
                    fn(h)
            return f

        def set_x(value, index):
            def fn(h):
                x = h["train/x"][...]
                x.flat[index] = value
                h["train/x"][...] = x
            return edit(fn)

        def replace(name, data):
            def fn(h):
                del h[name]
                h.create_dataset(name, data=data)
            return edit(fn)

        def huge(name):
            def fn(h):
                del h[name]
                h.create_dataset(name, shape=(2 ** 40, 8, 8, 1), dtype=np.float32, chunks=(1, 8, 8, 1))
            return edit(fn)

        variant("nan-x", set_x(np.nan, 64 * 7 + 3))
        variant("inf-x", set_x(-np.inf, 100))
        variant("nan-y", replace("train/y", np.array([0.5] * 63 + [np.nan], dtype=np.float32)))
        variant("labels-range", replace("train/y", np.array([1] * 40 + [200] + [1] * 23, dtype=np.int32)))
        variant("labels-negative", replace("train/y", np.array([-1] * 64, dtype=np.int32)))
        variant("y-short", replace("train/y", np.zeros(10, dtype=np.int32)))
        variant("x-wrong-dims", replace("train/x", np.zeros((64, 4, 16, 1), dtype=np.float32)))
        variant("x-rank1", replace("train/x", np.zeros(64, dtype=np.float32)))
        variant("x-strings", replace("train/x", np.array([b"abc"] * 64)))
        variant("x-huge", huge("train/x"))
        variant("no-test", edit(lambda h: h.__delitem__("test")))
        variant("test-empty", lambda p: (replace("test/x", np.zeros((0, 8, 8, 1), dtype=np.float32))(p),
                                         replace("test/y", np.zeros(0, dtype=np.int32))(p)))
        variant("y-missing", edit(lambda h: h.__delitem__("train/y")))
        variant("x-int-overflow", replace("train/x", np.full((64, 8, 8, 1), 1000, dtype=np.int32)))
        for n in (0, 8, 100, 512, size // 3, size // 2, size - 1):
            variant("trunc%d" % n, lambda p, n=n: os.truncate(p, n))
        for offset in (0, 8, 40, 100, 200, 400, 800, 1200, 2000, size // 2, size - 100):
            variant("flip%d" % offset, lambda p, o=offset: flip(p, o, 0xFF))
        for kind in ("fifo", "dir", "devzero"):
            variant(kind, replacing(kind))

    def plot_cases(self):
        """`dtrain plot` of a run whose metrics.jsonl is not a log dtrain writes: exit 2 (3 for I/O)
        naming metrics.jsonl, never SIGFPE, a hang on a FIFO or gnuplot's own complaint. Where the
        log reads, 0, or 2 naming gnuplot when it is not installed."""
        good = ('{"epoch": 1, "global_step": 3, "loss": 2.5, "accuracy": 0.25, "test_loss": 2.25, '
                '"test_accuracy": 0.5, "train_samples_per_s": 384.0}\n')

        def record(epoch, loss="2.0"):
            return '{"epoch": %s, "global_step": 3, "loss": %s}\n' % (epoch, loss)

        # Refused: exit 2 naming metrics.jsonl (and the line), or 3 for I/O.
        bad = {"empty": "", "blank": "\n\n\n", "garbage": "\x00\xff not json\n", "truncated": good[:30],
               "epoch-max": record(2 ** 63 - 1), "epoch-negative": record(-5), "epoch-zero": record(0),
               "epoch-fraction": record(1.5), "epoch-nan": record("nan"), "epoch-past-int": record(2 ** 31),
               "loss-inf": record(1, "inf"), "loss-null": good + record(2, "null")}
        # Drawn: exit 0, or 2 where gnuplot is not installed; never gnuplot failing on them.
        fine = {"no-newline": good.rstrip("\n"), "epoch-int-max": good + record(2 ** 31 - 1),
                "loss-huge": good + record(2, "1e308"), "many": "".join(record(e, 1.0 / e) for e in range(1, 3001))}

        def variant(name, mutate, drawn=False):
            def case():
                run = os.path.join(self.work, "plot-" + name)
                shutil.rmtree(run, ignore_errors=True)
                os.makedirs(run)
                log = os.path.join(run, "metrics.jsonl")
                open(log, "w").close()
                mutate(log)
                argv = [self.dtrain, "plot", run]
                rc, out, err = self.run(argv)
                if drawn:
                    self.judge("plot", name, argv, rc, out, err, names=("gnuplot is not installed",), allowed=(0, 2),
                               files=[run])
                else:
                    self.judge("plot", name, argv, rc, out, err, names=("metrics.jsonl",), allowed=(2, 3), files=[run])
                shutil.rmtree(run, ignore_errors=True)
            self.fixed.append(case)

        for name, text in bad.items():
            variant(name, writing(text, "w"))
        for name, text in fine.items():
            variant(name, writing(text, "w"), drawn=True)
        for kind in ("fifo", "dir", "dangling", "devnull"):
            variant(kind, replacing(kind))

    def csv_cases(self):
        """`tools/to_hdf5 csv` of features holding NaN or infinity (as float() reads them: nan, inf,
        Infinity, 1e999), in the training or the --test file, and `npy` of such arrays: exit 2 with
        one `tools/to_hdf5:` line naming the file, never a traceback."""
        tool = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "to_hdf5")
        rows = np.random.default_rng(9).integers(0, 255, size=(40, 4))

        def write_csv(path, bad=None):
            lines = ["f1,f2,f3,f4,label"] + ["%s,%d" % (",".join(str(v) for v in row), i % 3) for i, row in enumerate(rows)]
            if bad:
                row, column, cell = bad
                cells = lines[1 + row].split(",")
                cells[column] = cell
                lines[1 + row] = ",".join(cells)
            with open(path, "w") as f:
                f.write("\n".join(lines) + "\n")

        def variant(name, cell, in_test):
            def case():
                d = os.path.join(self.work, "csv-" + name)
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(d)
                bad = (self.rng.randrange(len(rows)), self.rng.randrange(4), cell)
                train, test = os.path.join(d, "train.csv"), os.path.join(d, "test.csv")
                write_csv(train, None if in_test else bad)
                write_csv(test, bad if in_test else None)
                argv = [tool, "csv", train, "--label", "label", "--test", test, "-o", os.path.join(d, "out.h5")]
                rc, out, err = self.run(argv)
                self.judge("csv", name, argv, rc, out, err, names=(os.path.basename(test if in_test else train),),
                           files=[d], prefix="tools/to_hdf5:")
                shutil.rmtree(d, ignore_errors=True)
            self.fixed.append(case)

        for i, cell in enumerate(("nan", "NaN", "inf", "-inf", "Infinity", "-Infinity", "1e999", " nan ", "+inf")):
            variant("cell%d-%s" % (i, cell.strip()), cell, in_test=i % 3 == 2)

        def npy_case(value):
            def case():
                d = os.path.join(self.work, "npy-%s" % value)
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(d)
                x = np.random.default_rng(10).random((30, 6), dtype=np.float32)
                x.flat[self.rng.randrange(x.size)] = value
                np.save(os.path.join(d, "x.npy"), x)
                np.save(os.path.join(d, "y.npy"), np.arange(30) % 3)
                argv = [tool, "npy", os.path.join(d, "x.npy"), os.path.join(d, "y.npy"), "-o", os.path.join(d, "out.h5")]
                rc, out, err = self.run(argv)
                self.judge("csv", "npy-%s" % value, argv, rc, out, err, names=("x.npy",), files=[d],
                           prefix="tools/to_hdf5:")
                shutil.rmtree(d, ignore_errors=True)
            self.fixed.append(case)

        for value in (np.nan, np.inf, -np.inf):
            npy_case(value)

    # ------------------------------------------------------------------ checkpoints

    def base_run(self):
        """A finished run with checkpoints after epochs 1..3 (max_to_keep 5), on IDX data."""
        data = os.path.join(self.work, "ckpt-data")
        self.make_idx_dir(data)
        self.ckpt_exp = os.path.join(self.work, "ckpt.yaml")
        self.experiment(self.ckpt_exp, "idx", data, "checkpoint: {every_epochs: 1, max_to_keep: 5}\n")
        with open(self.ckpt_exp) as f:
            text = f.read().replace("epochs: 2", "epochs: 3")
        with open(self.ckpt_exp, "w") as f:
            f.write(text)
        self.base = os.path.join(self.work, "base-run")
        shutil.rmtree(self.base, ignore_errors=True)
        argv = [self.dtrain, "run", self.ckpt_exp, "--run-dir", self.base]
        rc, out, err = self.run(argv, timeout=300)
        if rc != 0:
            sys.exit("files.py: the base run failed (exit %s):\n%s" % (rc, err))
        self.ckpts = sorted(os.listdir(os.path.join(self.base, "checkpoints")))
        self.newest = max((c for c in self.ckpts if c.startswith("ckpt-")), key=lambda c: int(c[5:-3]))

    @staticmethod
    def reseal(path):
        """Recomputes the whole-file checksum after an edit (the seal layout of checkpoint.cpp)."""
        with open(path, "r+b") as f:
            data = f.read()
            if data[:8] != b"DTRAINCK":
                return
            body = data[SEAL_BYTES:]
            f.seek(12)
            f.write(struct.pack("<QI", len(body), zlib.crc32(body) & 0xFFFFFFFF))

    @staticmethod
    def set_dataset(path, name, value, dtype=None):
        """Rewrites a dataset with h5py (its crc32 attribute recomputed), then the seal."""
        with h5py.File(path, "r+") as h:
            arr = np.asarray(value, dtype=dtype if dtype else h[name].dtype)
            if name in h:
                del h[name]
            ds = h.create_dataset(name, data=arr)
            ds.attrs.create("crc32", zlib.crc32(arr.tobytes()) & 0xFFFFFFFF, dtype=np.uint32)
        Harness.reseal(path)

    def checkpoint_mutation(self, path):
        """Mutates the checkpoint at `path` in place; returns a description."""
        size = os.path.getsize(path)
        r = self.rng
        kind = r.choice(["flip-seal", "flip-superblock", "flip-meta", "flip-any", "flip-any-resealed", "truncate",
                         "state", "state", "metrics", "drop", "attr", "experiment", "zero-block", "nonfinite",
                         "nonfinite", "iterations"])
        if kind.startswith("flip"):
            lo, hi = {"flip-seal": (0, 24), "flip-superblock": (SEAL_BYTES, SEAL_BYTES + 96),
                      "flip-meta": (SEAL_BYTES, min(size, SEAL_BYTES + 4096))}.get(kind, (0, size))
            offset = r.randrange(lo, hi)
            bit = r.randrange(8)
            flip(path, offset, 1 << bit)
            if kind == "flip-any-resealed":
                self.reseal(path)
            return "%s at %d bit %d" % (kind, offset, bit)
        if kind == "truncate":
            n = r.randrange(0, size)
            os.truncate(path, n)
            return "truncate to %d of %d" % (n, size)
        if kind == "zero-block":
            offset = r.randrange(0, size)
            n = r.randrange(1, 256)
            with open(path, "r+b") as f:
                f.seek(offset)
                f.write(b"\0" * n)
            return "zero %d bytes at %d" % (n, offset)
        big = [2 ** 63 - 1, 2 ** 62, 2 ** 31, 2 ** 31 - 1, -1, -(2 ** 63), 10 ** 6, 3, 0]
        if kind == "state":
            name = r.choice(["epoch", "step_in_epoch", "global_step", "epoch_samples", "epoch_loss_sum", "seed"])
            if name == "epoch_loss_sum":
                value = r.choice([float("nan"), float("inf"), -1e308, 0.0])
            elif name == "seed":
                value = r.choice([0, 2 ** 64 - 1])
            else:
                value = r.choice(big)
            self.set_dataset(path, "/state/" + name, value)
            return "/state/%s = %r" % (name, value)
        if kind == "nonfinite":
            # A diverged run's weights or slots (or a file resealed around them): checksums that hold.
            with h5py.File(path, "r") as h:
                names = []
                h.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset)
                             and n.split("/")[0] in ("model", "optimizer") else None)
                name = r.choice(names)
                value = h[name][...]
            count = r.randrange(1, value.size + 1)
            for i in r.sample(range(value.size), count):
                value.flat[i] = r.choice([np.nan, np.inf, -np.inf])
            self.set_dataset(path, "/" + name, value)
            return "%d non-finite values in /%s (checksums recomputed)" % (count, name)
        if kind == "iterations":
            value = r.choice(big)
            with h5py.File(path, "r+") as h:
                h["optimizer"].attrs.modify("iterations", np.int64(value))
            self.reseal(path)
            return "/optimizer iterations = %d" % value
        if kind == "metrics":
            n = r.choice([0, 1, 3, 100])
            which = r.choice(["counts", "sums"])
            with h5py.File(path, "r+") as h:
                if "state/metrics/0" not in h:
                    h.create_group("state/metrics/0")
            value = np.arange(n, dtype=np.int64) * r.choice([1, -1, 2 ** 40]) if which == "counts" \
                else np.full(n, r.choice([1.0, float("nan")]))
            self.set_dataset(path, "/state/metrics/0/" + which, value, np.int64 if which == "counts" else np.float64)
            return "/state/metrics/0/%s = %d values" % (which, n)
        if kind == "drop":
            with h5py.File(path, "r") as h:
                names = []
                h.visit(names.append)
            name = r.choice(names)
            with h5py.File(path, "r+") as h:
                del h[name]
            self.reseal(path)
            return "deleted /%s" % name
        if kind == "attr":
            with h5py.File(path, "r") as h:
                names = [""]
                h.visit(names.append)
            name = r.choice(names) or "/"
            with h5py.File(path, "r+") as h:
                obj = h[name]
                attr = r.choice(["format_version", "crc32", "name", "iterations", "created_by"])
                obj.attrs[attr] = r.choice([2 ** 40, -5, "x", 1.5, np.array([1, 2])])
            self.reseal(path)
            return "attribute %s of %s changed" % (attr, name)
        # experiment
        text = r.choice(["", "name: [", "a: &a [x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a]\nc: [*b,*b,*b,*b]\n",
                         "name: fuzz\nmodel: {input_shape: [8, 8, 1], layers: [{dense: {units: 1000000000}}]}\n",
                         "\0" * 10])
        with h5py.File(path, "r+") as h:
            del h["experiment"]
            data = np.array(text.encode() or b"\0", dtype="S%d" % max(1, len(text.encode())))
            ds = h.create_dataset("experiment", data=data)
            ds.attrs.create("crc32", zlib.crc32(text.encode() or b"\0") & 0xFFFFFFFF, dtype=np.uint32)
        self.reseal(path)
        return "experiment replaced (%d bytes)" % len(text)

    def checkpoint_case(self, index):
        run = os.path.join(self.work, "ckpt-run")
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(self.base, run)
        target = os.path.join(run, "checkpoints", self.newest)
        try:
            what = self.checkpoint_mutation(target)
        except Exception as e:  # h5py could not open a file an earlier mutation left unreadable
            what = "mutation failed (%s): left as is" % type(e).__name__
        name = "%d: %s" % (index, what)
        self.checkpoints += 1
        argv = [self.dtrain, "eval", "--checkpoint", target]
        rc, out, err = self.run(argv)
        ok = self.judge("ckpt-eval", name, argv, rc, out, err, names=(self.newest,), files=[target])
        argv = [self.dtrain, "resume", run, "--set", "train.epochs=4"]
        rc, out, err = self.run(argv, timeout=120)
        ok = self.judge("ckpt-resume", name, argv, rc, out, err, names=(self.newest,), files=[run]) and ok
        if rc == 0 and "skipping" not in err and "Resuming from " + target not in out:
            # Resuming from the mutated file itself is fine only when it still reads as a checkpoint.
            pass
        leftovers = [f for f in os.listdir(os.path.join(run, "checkpoints")) if ".tmp-" in f]
        if leftovers:
            self.save_bad("ckpt-resume", name, argv, rc, out, err, "left " + ", ".join(leftovers), [run])
        return ok

    def manifest_cases(self):
        def prepare(name, mutate, allowed=(0,)):
            run = os.path.join(self.work, "manifest-" + name)
            shutil.rmtree(run, ignore_errors=True)
            shutil.copytree(self.base, run)
            manifest = os.path.join(run, "checkpoints", "checkpoint")
            mutate(manifest)
            argv = [self.dtrain, "resume", run, "--set", "train.epochs=4"]
            rc, out, err = self.run(argv, timeout=120)
            ok = self.judge("manifest", name, argv, rc, out, err, names=("checkpoint",), files=[run], allowed=allowed)
            if ok and rc == 0 and ("Resuming from " + os.path.join(run, "checkpoints", self.newest)) not in out:
                self.save_bad("manifest", name, argv, rc, out, err, "did not resume from the newest checkpoint", [run])
            for c in self.ckpts:
                if c.startswith("ckpt-") and not os.path.exists(os.path.join(run, "checkpoints", c)) and \
                        int(c[5:-3]) > int(self.newest[5:-3]) - 1:
                    self.save_bad("manifest", name, argv, rc, out, err, "deleted " + c, [run])

        listed = [c for c in self.ckpts if c.startswith("ckpt-")]
        listed.sort(key=lambda c: int(c[5:-3]))

        def write(text):
            return writing(text, "w")

        prepare("empty", write(""))
        prepare("garbage", write("\x00\xff garbage ../../etc/passwd\n"))
        prepare("reversed", write("".join(c + "\n" for c in reversed(listed))))
        prepare("repeated", write("".join(c + "\n" for c in listed for _ in range(3))))
        prepare("deleted", os.remove)
        prepare("fifo", replacing("fifo"))
        prepare("directory", lambda p: (os.remove(p), os.mkdir(p)), allowed=(3,))  # cannot be replaced: refused
        prepare("absent-names", write("ckpt-1.h5\nckpt-2.h5\n"))

    # ------------------------------------------------------------------ signals

    def signal_case(self, index, mpi=False):
        r = self.rng
        run = os.path.join(self.work, "signal-run")
        shutil.rmtree(run, ignore_errors=True)
        exp = os.path.join(self.work, "signal.yaml")
        with open(self.ckpt_exp) as f:
            text = f.read().replace("epochs: 3", "epochs: 40").replace("every_epochs: 1", "every_epochs: 1, every_steps: 3")
        if mpi:
            text = text.replace("{kind: default}", "{kind: multi_worker_mirrored}")
        with open(exp, "w") as f:
            f.write(text)
        sig = r.choice([signal.SIGTERM, signal.SIGINT] + ([signal.SIGUSR1] * 2 if mpi else []))
        double = r.random() < 0.35
        delay = r.uniform(0.0, 3.0)
        argv = [self.dtrain, "run", exp, "--run-dir", run]
        if mpi:
            argv = ["mpirun", "--oversubscribe", "-n", "2", "--mca", "odls_base_sigkill_timeout", "30"] + argv
        name = "%d: %s%s after %.2f s%s" % (index, "double " if double else "", signal.Signals(sig).name, delay,
                                            " under mpirun -n 2" if mpi else "")
        env = dict(self.env)
        if mpi:
            # OpenMPI's components are unloaded before exit, so what they keep for the process's
            # lifetime shows as leaks from "<unknown module>" that no suppression can name. Leaks
            # are checked in the single-process cases; the MPI ones check everything else.
            env["ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "") + ":detect_leaks=0"
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=self.work,
                             stdin=subprocess.DEVNULL, errors="replace")
        if not mpi:
            # The moments that count start once dtrain has blocked the signals (the first thing its
            # run command does); before that, while the loader and the sanitizer start, a signal has
            # its default action in any program.
            self.wait_until_blocked(p.pid, sig)
        time.sleep(delay)
        p.send_signal(sig)
        if double:
            time.sleep(r.uniform(0.0, 0.5))
            p.send_signal(sig)
        rc, out, err = self.finish(p, 120)
        allowed = [0, 4]
        if double:
            allowed.append(128 + sig)
        if mpi and sig != signal.SIGUSR1:
            allowed.append(1)  # mpirun's own status when it aborts the job on SIGTERM/SIGINT (docs/multi_worker.md)
        if mpi:
            time.sleep(1)  # ranks outliving mpirun would show as temporaries or new files below
        ok = self.judge("signal-mpi" if mpi else "signal", name, argv, rc, out, err, allowed=tuple(allowed), files=[run])
        ckdir = os.path.join(run, "checkpoints")
        leftovers = [f for f in os.listdir(ckdir) if ".tmp-" in f] if os.path.isdir(ckdir) else []
        if leftovers:
            self.save_bad("signal", name, argv, rc, out, err, "left " + ", ".join(leftovers), [run])
            ok = False
        if mpi and sig == signal.SIGUSR1 and not double and rc not in (0, 4):
            ok = False
        if rc in (4, 128 + sig, 1) and os.path.isdir(ckdir) and os.listdir(ckdir):
            # Whatever stopped it, the run must resume.
            argv2 = [self.dtrain, "resume", run, "--set", "train.epochs=1"]
            rc2, out2, err2 = self.run(argv2, timeout=120)
            ok = self.judge("signal-resume", name, argv2, rc2, out2, err2, files=[run], allowed=(0,)) and ok
        return ok

    @staticmethod
    def finish(p, timeout):
        """(exit code, stdout, stderr) of the started process `p`; the code is None (a hang) when it
        has not ended within `timeout` seconds, and it is killed."""
        try:
            out, err = p.communicate(timeout=timeout)
            return p.returncode, out, err
        except subprocess.TimeoutExpired:
            # The whole tree: mpirun and its ranks hold the pipes open, so killing only `p` (a
            # launcher script) would leave communicate() waiting for them forever.
            for pid in [p.pid] + descendants(p.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            out, err = p.communicate()
            return None, out, err

    def rank_pid(self, run, rank):
        """The PID of the dtrain process of world rank `rank` writing into `run`, or None."""
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.path.realpath("/proc/%s/exe" % entry) != os.path.realpath(self.dtrain):
                    continue
                with open("/proc/%s/cmdline" % entry, "rb") as f:
                    if run.encode() not in f.read():
                        continue
                with open("/proc/%s/environ" % entry, "rb") as f:
                    env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            except OSError:
                continue
            if env.get(b"OMPI_COMM_WORLD_RANK") == str(rank).encode():
                return int(entry)
        return None

    def recovery_case(self, index):
        """One rank of a parameter-server job under --enable-recovery killed at a random step (see
        the module's docstring for the outcomes each loss must have)."""
        r = self.rng
        run = os.path.join(self.work, "recovery-run")
        hold = run + ".hold"
        for d in (run, hold):
            shutil.rmtree(d, ignore_errors=True)
        exp = os.path.join(self.work, "recovery.yaml")
        with open(self.ckpt_exp) as f:
            text = f.read().replace("epochs: 3", "epochs: 2").replace(
                "{kind: default}", "{kind: parameter_server, roles: {chief: 1, ps: 1, worker: 2}, "
                "communication: {timeout_seconds: 4}}").replace("every_epochs: 1", "every_epochs: 1, every_steps: 3")
        with open(exp, "w") as f:
            f.write(text)
        # World ranks: 0 the chief (coordinator), 1 and 2 the workers, 3 the server.
        victim = r.choice([0, 1, 1, 2, 3])
        step = r.randint(1, 6)
        role = {0: "chief", 1: "worker", 2: "worker", 3: "server"}[victim]
        name = "%d: the %s (rank %d) killed at step %d" % (index, role, victim, step)
        tool = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dtrain-mpirun")
        argv = [tool, "--oversubscribe", "--enable-recovery", "-n", "4", self.dtrain, "run", exp, "--run-dir", run]
        env = dict(self.env)
        env["ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "") + ":detect_leaks=0"  # as in the MPI signal cases
        env["DTRAIN_TEST_HOLD_DIR"], env["DTRAIN_TEST_HOLD_AT_STEP"] = hold, str(step)
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=self.work,
                             stdin=subprocess.DEVNULL, errors="replace")
        # The chief holds at the step (the workers wait for its orders): the blow lands there.
        held = os.path.join(hold, "held.rank0")
        until = time.monotonic() + 120
        while not os.path.exists(held) and p.poll() is None and time.monotonic() < until:
            time.sleep(0.02)
        pid = self.rank_pid(run, victim) if os.path.exists(held) else None
        if pid:
            os.kill(pid, signal.SIGKILL)
        os.makedirs(hold, exist_ok=True)
        open(os.path.join(hold, "release"), "w").close()
        rc, out, err = self.finish(p, 180)
        # OpenMPI 4.1's PMIx prints this when it tells the survivors of a lost process under
        # --enable-recovery: its noise, not a sanitizer's "ERROR: ".
        err = "\n".join(l for l in err.splitlines() if "PMIX ERROR: BAD-PARAM" not in l)
        if not pid:
            return self.judge("recovery", name + " (no rank to kill: the run ended first)", argv, rc, out, err,
                              allowed=(0,), files=[run])
        want = {"worker": 0, "server": 5, "chief": 1}[role]
        ok = self.judge("recovery", name, argv, rc, out, err, allowed=(want,), files=[run, exp])
        if ok and role == "worker" and not any(f.endswith(".h5") and ".tmp-" not in f for f in
                                                os.listdir(os.path.join(run, "checkpoints"))):
            self.save_bad("recovery", name, argv, rc, out, err, "a survived loss left no checkpoint", [run])
            ok = False
        ckdir = os.path.join(run, "checkpoints")
        for f in sorted(os.listdir(ckdir)) if os.path.isdir(ckdir) else []:
            if not f.endswith(".h5") or ".tmp-" in f:
                continue
            argv2 = [self.dtrain, "eval", "--checkpoint", os.path.join(ckdir, f)]
            rc2, out2, err2 = self.run(argv2, timeout=120)
            ok = self.judge("recovery-eval", name + ": " + f, argv2, rc2, out2, err2, allowed=(0,), files=[run]) and ok
        return ok

    @staticmethod
    def wait_until_blocked(pid, sig, limit=30.0):
        until = time.monotonic() + limit
        while time.monotonic() < until:
            try:
                with open("/proc/%d/status" % pid) as f:
                    for line in f:
                        if line.startswith("SigBlk:") and int(line.split()[1], 16) & (1 << (sig - 1)):
                            return
            except OSError:
                return  # already gone
            time.sleep(0.005)

    # ------------------------------------------------------------------ the campaign

    def signals_only(self, mpi):
        """Signal timings alone (half of them under mpirun when it is there) until the time is up."""
        self.fixed, self.fixed_total = [], 0
        self.base_run()
        i = 0
        while self.time_left() > 0:
            i += 1
            self.signal_case(i, mpi=mpi and i % 2 == 0)

    def campaign(self, mpi):
        """Within the time: the fixed data-file cases (in a seeded order) interleaved with random
        corrupted checkpoints (all from one base run), a signal case every eighth round (every
        third of them under mpirun); then checkpoints until the end. Past --seconds, while a
        target is unmet, only what it lacks runs."""
        self.fixed = []
        self.idx_cases()
        self.hdf5_cases()
        self.plot_cases()
        self.csv_cases()
        self.fixed_total = len(self.fixed)
        self.rng.shuffle(self.fixed)
        print("files.py: %d data-file cases; base run for the checkpoint cases" % self.fixed_total, flush=True)
        self.base_run()
        self.manifest_cases()
        i = 0
        while self.going_on():
            i += 1
            overtime = self.time_left() <= 0
            for _ in range(3):
                if self.fixed and (self.time_left() > 0 or overtime):
                    self.fixed.pop()()
            if not overtime or self.checkpoints < self.min_checkpoints:
                self.checkpoint_case(i)
            if i % 8 == 0 and self.time_left() > 0:
                self.signal_case(i, mpi=mpi and i % 24 == 0)
            if mpi and i % 24 == 12 and self.time_left() > 0:
                self.recovery_case(i)

    def summary(self):
        total = sum(self.counts.values())
        seconds = time.monotonic() - self.started
        print("files.py: %d outcomes in %.0f s: %s" % (total, seconds,
                                                       ", ".join("%s %d" % kv for kv in sorted(self.counts.items()))))
        print("files.py: data-file cases run: %d of %d%s" % (self.fixed_total - len(self.fixed), self.fixed_total,
                                                             "" if not self.fixed else " (give more --seconds for all)"))
        print("files.py: corrupted checkpoints: %d%s" % (
            self.checkpoints, " (target %d: %s)" % (self.min_checkpoints, "met" if self.targets_met() else "NOT met")
            if self.min_checkpoints else ""))
        with open(os.path.join(self.out, "summary.json"), "w") as f:
            json.dump({"seconds": round(seconds), "data_cases": self.fixed_total - len(self.fixed),
                       "data_cases_total": self.fixed_total, "checkpoints": self.checkpoints,
                       "min_checkpoints": self.min_checkpoints, "targets_met": self.targets_met(),
                       "outcomes": self.counts, "bad": len(self.bad)}, f)
        if self.bad:
            print("files.py: %d bad outcomes:" % len(self.bad))
            for b in self.bad:
                print("  " + b)
        else:
            print("files.py: no bad outcome")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtrain", required=True, help="the dtrain binary to test (the ASan build)")
    parser.add_argument("--seconds", type=float, default=120, help="time budget (the base run and the case running "
                        "when it ends come on top)")
    parser.add_argument("--min-checkpoints", type=int, default=0, help="go on past --seconds (up to --max-seconds) "
                        "until this many corrupted checkpoints and every data-file case have run")
    parser.add_argument("--max-seconds", type=float, default=0, help="hard cap for --min-checkpoints (default: "
                        "--seconds, no overtime)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", required=True, help="directory for the work files and the reproducers")
    parser.add_argument("--no-mpi", action="store_true", help="skip the mpirun -n 2 signal cases")
    parser.add_argument("--signals-only", action="store_true", help="only signal timings (a campaign of its own)")
    args = parser.parse_args()
    h = Harness(args)
    mpi = not args.no_mpi and shutil.which("mpirun") is not None
    if args.signals_only:
        h.signals_only(mpi)
    else:
        h.campaign(mpi)
    h.summary()
    if h.bad:
        return 1
    return 3 if args.min_checkpoints and not h.targets_met() else 0


if __name__ == "__main__":
    sys.exit(main())
