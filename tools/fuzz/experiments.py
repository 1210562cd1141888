#!/usr/bin/python3
"""Fuzzes dtrain's experiment handling: mutated experiments and --set values.

  tools/fuzz/experiments.py --dtrain build-asan/dtrain --seconds 600 --seed 1 --out /tmp/fuzz

Starts from the shipped experiments (experiments/*.yaml) and mutates them: keys deleted, values
of another type, huge, negative, zero, NaN and infinite numbers, long strings, deep nesting,
aliases (shared blocks and "billion laughs"), unicode, duplicated keys, broken YAML, and random
--set overrides. Every case runs `dtrain validate`; those that validate also run a short
`dtrain run` (one epoch of two steps, one thread) on the small Fashion-MNIST subset in data/.

Every eighth case, where the harness can make a memory cgroup (root, a writable memory
controller), is an oversized or a modest model (the small CNN with a dense layer, the first
conv2d's filters or the batch scaled so that its parameters or activations need either at least
1.5 times a 768 MB limit, or a small part of it), validated and run inside a cgroup with that
limit: an oversized one must be refused (exit 2, one line naming the cgroup's limit) before it is
allocated, a modest one must validate; neither may be killed by the kernel's OOM killer.

With --min-experiments N it goes on past --seconds, up to --max-seconds, until N mutated
experiments have run, and says whether it got there.

Each outcome must be exit 0, or exit 2/3 with one `dtrain: error:` line on stderr that names the
experiment file (with line:column when the YAML itself is wrong) or the --set text; warnings
(`dtrain: warning:`) may come before it. A signal, an abort, a sanitizer report, exit 1, any other
code, other text on stderr or a time-out is a bad outcome: its reproducer (the YAML, the command,
stdout and stderr) is saved under OUT/bad-NNNN/. Prints a summary (also OUT/summary.json); exits 1
when any outcome was bad, 3 when a --min-experiments target was not reached in time.
Deterministic for a given --seed (apart from which case the time limit stops at).
"""
import argparse
import copy
import json
import math
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL_DATA = "data/fashion_mnist_small.h5"
VALIDATE_TIMEOUT = 60
RUN_TIMEOUT = 180
SANITIZER = re.compile(r"AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|runtime error:|"
                       r"ThreadSanitizer|stack-overflow|SUMMARY: ")

NUMBERS = [0, -1, 1, 2, 3, 7, 64, 65, 1000, 2**20, 2**31 - 1, 2**31, 2**32, 4294967296, 2**62, 2**63 - 1, 2**63,
           2**64, -2**63, 10**30, 0.0, -0.0, 0.5, -0.5, 1e-320, 1e308, -1e308, float("nan"), float("inf"),
           float("-inf"), 1e9, 3.5]
STRINGS = ["", " ", "x", "auto", "none", "null", "~", "yes", "no", "true", "0x10", "1e3", "-", ".", "..", "../../x",
           "/", "/dev/null", "/etc/passwd", "a/b", "é", "日本語", "\u202e", "😀", "a\tb", "a: b", "[1, 2]", "{a: 1}",
           "x" * 5000, "%s%n", "\\", "'", '"', "#", "&a", "*a", "!!binary", "cpu:0", "gpu:0", "cpu:99999999999"]


def interesting_scalar(rng):
    r = rng.random()
    if r < 0.55:
        return rng.choice(NUMBERS)
    if r < 0.9:
        return rng.choice(STRINGS)
    return rng.choice([True, False, None])


def interesting_value(rng, depth=0):
    r = rng.random()
    if r < 0.7 or depth > 2:
        return interesting_scalar(rng)
    if r < 0.85:
        return [interesting_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["kind", "units", "x", "é", "", "name", "size"]): interesting_value(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}


def paths(node, prefix=()):
    """Every (path, value) in the tree, containers included, at most 40 levels down (an alias can
    make the tree contain itself)."""
    yield prefix, node
    if len(prefix) >= 40:
        return
    if isinstance(node, dict):
        for k, v in node.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from paths(v, prefix + (i,))


def get_parent(tree, path):
    node = tree
    for p in path[:-1]:
        node = node[p]
    return node


def mutate_tree(tree, rng, op=None):
    """One structural mutation of the parsed experiment, in place; returns its description."""
    all_paths = [p for p, _ in paths(tree) if p]
    if not all_paths:
        return "empty"
    path = rng.choice(all_paths)
    parent = get_parent(tree, path)
    key = path[-1]
    value = parent[key]
    op = op or rng.choice(["delete", "scalar", "scalar", "scalar", "type", "nest", "alias", "rename", "grow", "number",
                     "tweak", "tweak", "tweak", "tweak"])
    where = ".".join(str(p) for p in path)
    if op == "delete":
        del parent[key]
    elif op == "scalar":
        parent[key] = interesting_scalar(rng)
    elif op == "type":
        if isinstance(value, (dict, list)):
            parent[key] = interesting_scalar(rng)
        else:
            parent[key] = rng.choice([[value], {"value": value}, [value, value], str(value)])
    elif op == "nest":
        deep = value
        for _ in range(rng.choice([5, 40, 70, 200])):
            deep = [deep] if rng.random() < 0.5 else {"a": deep}
        parent[key] = deep
    elif op == "alias":
        # The same Python object twice: PyYAML writes an anchor and an alias.
        shared = value if isinstance(value, (dict, list)) else [value]
        parent[key] = shared
        target = get_parent(tree, rng.choice(all_paths)) if rng.random() < 0.5 else tree
        if isinstance(target, dict):
            target[rng.choice(["extra", "model", "data", key if isinstance(key, str) else "k"])] = shared
        elif isinstance(target, list):
            target.append(shared)
    elif op == "rename":
        if isinstance(parent, dict):
            new_key = rng.choice([str(key) + "s", str(key)[:-1], str(key).upper(), "é" + str(key), "", "1",
                                  str(key) + " ", "x" * 300])
            parent[new_key] = parent.pop(key)
    elif op == "grow":
        if isinstance(value, list):
            value.extend(copy.deepcopy(value[:1]) * rng.choice([1, 2, 30, 300]))
        elif isinstance(value, dict):
            for i in range(rng.choice([1, 5, 500])):
                value[f"unknown_{i}"] = interesting_scalar(rng)
        else:
            parent[key] = [value] * rng.choice([2, 8])
    elif op == "tweak":
        # A plausible value, so that many mutants validate and train: what limits must catch hides
        # among sizes that work.
        if isinstance(value, bool):
            parent[key] = not value
        elif isinstance(value, int):
            parent[key] = rng.choice([0, 1, 2, 3, 5, 7, 13, 64, 65, 100, 1000, 4096, value * 2, max(0, value - 1)])
        elif isinstance(value, float):
            parent[key] = rng.choice([0.0, 0.1, 0.5, 0.9, 0.999, 1.0, 1e-9, 10.0, value * 10, value / 10])
        elif isinstance(value, list) and value:
            del value[rng.randrange(len(value))]
        elif isinstance(value, dict) and value:
            del value[rng.choice(list(value))]
    elif op == "number":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parent[key] = rng.choice([value * 1000, value + 1, -value, value * 2**31, value / 3, 0,
                                      float("nan"), 2**63 - 1])
        else:
            parent[key] = rng.choice(NUMBERS)
    return f"{op} {where}"


def billion_laughs(levels, width):
    text = "laugh_a: &laugh_a [" + ", ".join(["lol"] * width) + "]\n"
    prev = "laugh_a"
    for i in range(1, levels):
        name = f"laugh_{chr(ord('a') + i)}"
        text += f"{name}: &{name} [" + ", ".join([f"*{prev}"] * width) + "]\n"
        prev = name
    return text, prev


def mutate_text(text, rng):
    """A mutation of the YAML text itself; returns (text, description)."""
    lines = text.split("\n")
    op = rng.choice(["dup_line", "laughs", "laughs_inside", "cut", "indent", "junk", "bom", "tab", "anchor_loop"])
    if op == "dup_line" and lines:
        i = rng.randrange(len(lines))
        lines.insert(i, lines[i])
        return "\n".join(lines), f"duplicated line {i + 1}"
    if op == "laughs":
        levels, width = rng.choice([(10, 9), (6, 10), (3, 4), (20, 2)])
        laughs, _ = billion_laughs(levels, width)
        return laughs + text, f"billion laughs {levels}x{width} at the top"
    if op == "laughs_inside":
        levels, width = rng.choice([(10, 9), (5, 10)])
        laughs, last = billion_laughs(levels, width)
        return laughs + text.replace("metrics:", f"metrics: *{last}\nunused_metrics:", 1), "billion laughs as metrics"
    if op == "cut":
        return text[:rng.randrange(max(1, len(text)))], "truncated"
    if op == "indent" and lines:
        i = rng.randrange(len(lines))
        lines[i] = " " * rng.choice([1, 3, 7]) + lines[i]
        return "\n".join(lines), f"indented line {i + 1}"
    if op == "junk":
        pos = rng.randrange(len(text) + 1)
        junk = rng.choice(["{", "]", ": :", "&", "*nope", "!!python/object:os.system", "\x00", "\xff", "---\n",
                           "...\n", "? ", "|", ">", "%YAML 1.2\n", "<<: *x\n", "\u2028"])
        return text[:pos] + junk + text[pos:], f"junk {junk!r} at {pos}"
    if op == "bom":
        return "\ufeff" + text, "byte order mark"
    if op == "tab" and lines:
        i = rng.randrange(len(lines))
        lines[i] = lines[i].replace("  ", "\t", 1)
        return "\n".join(lines), f"tab on line {i + 1}"
    if op == "anchor_loop":
        return text + "\nloop: &loop [*loop]\n", "alias inside its own anchor"
    return text, "unchanged"


def dump(tree):
    return yaml.safe_dump(tree, sort_keys=False, allow_unicode=True, width=4096)


def random_set(tree, rng):
    all_paths = [p for p, _ in paths(tree) if p]
    r = rng.random()
    if r < 0.1:
        return rng.choice(["", "=", "x", "=3", "a..b=1", ".a=1", "a.=1", "train.epochs", "model.layers.99=1",
                           "model.layers.x=1", "data.path.x=1", "name=" + "n" * 3000, "é=1",
                           "model.layers.0=" + "[" * 100, "train.epochs=*a", "train.epochs=&a 1",
                           "a: &a [x, x]", "seed=-1", "seed=18446744073709551616"])
    if all_paths and r < 0.8:
        path = ".".join(str(p) for p in rng.choice(all_paths))
    else:
        path = rng.choice(["train.threads", "train.epochs", "train.steps_per_epoch", "data.batch_size_per_replica",
                           "data.global_batch_size", "data.eval_batch_size", "data.shuffle_buffer",
                           "data.validation_split", "model.input_shape", "model.layers.0", "checkpoint.max_to_keep",
                           "checkpoint.every_steps", "strategy.devices", "optimizer.learning_rate", "seed", "name",
                           "data.train_size", "data.shape", "data.classes", "loss.kind"])
    value = interesting_value(rng)
    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=1 << 20).strip()
    if text.endswith("\n..."):
        text = text[:-4].strip()
    text = text.replace("\n...", "")
    return f"{path}={text}"


def small_data(tree):
    """The shipped experiments read the full Fashion-MNIST; the runs use the subset in data/."""
    data = tree.get("data") if isinstance(tree, dict) else None
    if isinstance(data, dict) and data.get("source", "fashion_mnist") == "fashion_mnist":
        data["source"] = "hdf5"
        data["path"] = SMALL_DATA
        data.pop("shards", None)


def check_outcome(rc, stderr, timed_out, case_file):
    """'' when fine, else what was wrong."""
    if timed_out:
        return "timed out"
    if rc < 0:
        return f"killed by signal {-rc}"
    if SANITIZER.search(stderr):
        return "sanitizer report"
    if rc == 0:
        return ""
    if rc not in (2, 3):
        return f"exit {rc}"
    lines = [l for l in stderr.split("\n") if l.strip()]
    errors = [l for l in lines if l.startswith("dtrain: error: ")]
    others = [l for l in lines if not l.startswith("dtrain: error: ") and not l.startswith("dtrain: warning: ")]
    if len(errors) != 1 or others:
        return f"exit {rc} without exactly one error line ({len(errors)} error lines, {len(others)} other lines)"
    message = errors[0]
    name = os.path.basename(case_file)
    # A run that diverged names the epoch and step where its loss stopped being finite (exit 2,
    # README's exit codes): what the experiment makes of the data, not a key that is wrong.
    if message.startswith("dtrain: error: the training loss became "):
        return ""
    if name not in message and "--set " not in message and not re.search(r"(/|\.h5\b|ubyte)", message):
        return "the error names no file, no --set and no path"
    if "invalid YAML" in message and "--set " not in message and not re.search(re.escape(name) + r":\d+:\d+: ", message):
        return "a YAML error without line:column"
    return ""


MEMORY_LIMIT = 768 << 20


def make_memory_cgroup(directory_name):
    """A memory cgroup limited to MEMORY_LIMIT (v1, or v2 where the controller is delegated): its
    directory, or None where this machine lets the harness make none."""
    for root, limit_file in (("/sys/fs/cgroup/memory", "memory.limit_in_bytes"), ("/sys/fs/cgroup", "memory.max")):
        if limit_file == "memory.max":
            try:
                with open(os.path.join(root, "cgroup.subtree_control")) as f:
                    if "memory" not in f.read().split():
                        continue
            except OSError:
                continue
        elif not os.path.exists(os.path.join(root, limit_file)):
            continue
        path = os.path.join(root, directory_name)
        try:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, limit_file), "w") as f:
                f.write(str(MEMORY_LIMIT))
            return path
        except OSError:
            continue
    return None


def sized_model(rng, oversized):
    """--set overrides of the small CNN (conv2d 3x3 on 28x28x1 -> pooling -> conv2d 3x3 -> pooling
    -> flatten (1600) -> dense -> dense 10) and what they scale. Oversized: the parameters (16
    bytes each with gradient and Adam's slots) or the activations need at least 1.5 x MEMORY_LIMIT
    by themselves. Modest: what the process really holds stays well inside the limit even under
    AddressSanitizer, which about doubles a run's resident memory: a dense parameter costs about
    64 bytes in a run that saves a checkpoint (two lanes' copies with gradients, the slots, the
    checkpoint's image twice), and the ASan build starts at about 300 MB."""
    knob = rng.choice(["units", "filters", "batch", "lanes"])
    modest_units = MEMORY_LIMIT // 4 // (1600 * 64 * 2)
    if knob == "units":
        low, high = (int(1.5 * MEMORY_LIMIT / 25600) + 1, 2_000_000) if oversized else (64, modest_units)
        return [f"model.layers.5.dense.units={rng.randint(low, high)}"], knob
    if knob == "filters":  # 26 x 26 x filters activations per example, value and gradient, batch 64
        low, high = (int(1.5 * MEMORY_LIMIT / (26 * 26 * 8 * 64)) + 1, 10**6) if oversized else (8, 100)
        return [f"model.layers.0.conv2d.filters={rng.randint(low, high)}"], knob
    if knob == "batch":  # about 26 x 26 x 32 x 8 bytes of activations per example
        per_example = 26 * 26 * 32 * 8
        low, high = (int(1.5 * MEMORY_LIMIT / per_example) + 1, 2**24) if oversized else (1, MEMORY_LIMIT // 10 // per_example)
        return [f"data.batch_size_per_replica={rng.randint(low, high)}"], knob
    # Two lanes: two copies of the model (24 bytes a dense parameter in all).
    low, high = (int(1.5 * MEMORY_LIMIT / (1600 * 24)) + 1, 400_000) if oversized else (64, modest_units)
    return [f"model.layers.5.dense.units={rng.randint(low, high)}", "train.threads=2",
            "train.parallelism=batch"], knob


class Campaign:
    def __init__(self, args):
        self.args = args
        self.out = os.path.abspath(args.out)
        self.work = os.path.join(self.out, "work")
        os.makedirs(self.work, exist_ok=True)
        self.counts = {"experiments": 0, "set_cases": 0, "validate": 0, "run": 0, "ok": 0, "refused": 0, "bad": 0}
        self.kinds = {}
        self.bad = []
        self.cgroup = make_memory_cgroup(f"dtrain_fuzz_{os.getpid()}")
        self.counts["memory_cases"] = 0

    def memory_case(self, rng):
        """An oversized or a modest model inside a memory cgroup (see the module's docstring)."""
        oversized = rng.random() < 0.6
        overrides, knob = sized_model(rng, oversized)
        case_file = os.path.join(ROOT, "experiments", "fashion_mnist_small.yaml")
        with open(case_file, encoding="utf-8") as f:
            text = f.read()
        sets = [a for o in overrides for a in ("--set", o)]
        description = f"{'oversized' if oversized else 'modest'} {knob} in a {MEMORY_LIMIT >> 20} MB cgroup: " + \
            " ".join(sets)
        self.counts["memory_cases"] += 1
        self.counts["experiments"] += 1
        # The command enters the cgroup first: every allocation of the run is charged to it.
        enter = ["/bin/sh", "-c", 'echo $$ >"$0/cgroup.procs" && exec "$@"', self.cgroup]
        run_dir = os.path.join(self.work, "memory-run")
        shutil.rmtree(run_dir, ignore_errors=True)
        for verb, extra, timeout in (("validate", [], VALIDATE_TIMEOUT),
                                     ("run", ["--set", "train.epochs=1", "--set", "train.steps_per_epoch=1",
                                              "--set", "train.progress=none", "--run-dir", run_dir], RUN_TIMEOUT)):
            argv = enter + [self.args.dtrain, verb, case_file] + sets + extra
            rc, out, err, timed_out = self.execute(argv, timeout)
            self.counts[verb] += 1
            problem = check_outcome(rc, err, timed_out, case_file)
            if not problem and oversized and (rc != 2 or "memory limit of this process's cgroup" not in err):
                problem = f"an oversized model was not refused naming the cgroup's limit (exit {rc})"
            if not problem and not oversized and verb == "validate" and rc != 0:
                problem = f"a modest model did not validate (exit {rc})"
            self.record(argv, text, description + f" ({verb})", rc, out, err, timed_out, case_file, problem)
            if rc != 0:
                return

    def close(self):
        if self.cgroup:
            for _ in range(100):
                try:
                    os.rmdir(self.cgroup)
                    return
                except OSError:
                    time.sleep(0.05)

    def execute(self, argv, timeout):
        env = dict(os.environ)
        env.setdefault("ASAN_OPTIONS", "detect_leaks=0:abort_on_error=1")
        env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
        for attempt in range(5):
            try:
                p = subprocess.run(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                   timeout=timeout)
                return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace"), False
            except subprocess.TimeoutExpired as e:
                out = (e.stdout or b"").decode(errors="replace")
                err = (e.stderr or b"").decode(errors="replace")
                return -1000, out, err, True
            except OSError as e:  # the binary is being rebuilt: not an outcome of dtrain's
                if attempt == 4:
                    sys.exit(f"experiments.py: cannot start {argv[0]}: {e}")
                time.sleep(2)

    def record(self, argv, text, description, rc, out, err, timed_out, case_file, problem=None):
        if problem is None:
            problem = check_outcome(rc, err, timed_out, case_file)
        if rc == 0 and not problem:
            self.counts["ok"] += 1
        elif not problem:
            self.counts["refused"] += 1
        if not problem:
            return
        self.counts["bad"] += 1
        self.kinds[problem] = self.kinds.get(problem, 0) + 1
        target = os.path.join(self.out, f"bad-{len(self.bad):04d}")
        os.makedirs(target, exist_ok=True)
        with open(os.path.join(target, "experiment.yaml"), "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(text)
        shown = [a if a != case_file else "experiment.yaml" for a in argv]
        with open(os.path.join(target, "command.sh"), "w") as f:
            f.write(f"# {problem}; mutation: {description}\n# run from the repository root, with the experiment "
                    f"copied next to it\n{shlex.join(shown)}\n")
        with open(os.path.join(target, "stdout"), "w") as f:
            f.write(out)
        with open(os.path.join(target, "stderr"), "w") as f:
            f.write(err)
        self.bad.append((target, problem, description))
        print(f"BAD: {problem}: {description} -> {target}", flush=True)

    def case(self, rng, bases, index):
        name, tree = rng.choice(bases)
        tree = copy.deepcopy(tree)
        descriptions = [name]
        # Gentle cases (one plausible change) mostly validate and train; the others mostly test
        # how errors are reported.
        gentle = rng.random() < 0.4
        for _ in range(1 if gentle else rng.choice([1, 1, 1, 2, 3])):
            try:
                descriptions.append(mutate_tree(tree, rng, "tweak" if gentle else None))
            except RecursionError:  # an alias made the tree contain itself: dump it as it is
                break
        try:
            text = dump(tree)
        except (yaml.YAMLError, RecursionError, ValueError) as e:
            text = f"# could not dump: {e}\n"
        if not gentle and rng.random() < 0.3:
            text, d = mutate_text(text, rng)
            descriptions.append(d)
        overrides = []
        if not gentle and rng.random() < 0.4:
            for _ in range(rng.choice([1, 1, 2])):
                overrides.append(random_set(tree, rng))
            self.counts["set_cases"] += 1
            descriptions.append("--set " + " --set ".join(overrides))
        description = "; ".join(descriptions)
        case_file = os.path.join(self.work, f"case-{index % 4}.yaml")
        with open(case_file, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(text)
        sets = [a for o in overrides for a in ("--set", o)]
        self.counts["experiments"] += 1

        argv = [self.args.dtrain, "validate", case_file] + sets
        rc, out, err, timed_out = self.execute(argv, VALIDATE_TIMEOUT)
        self.counts["validate"] += 1
        self.record(argv, text, description, rc, out, err, timed_out, case_file)
        # Runs are slower: only some of the experiments that validate train.
        if rc != 0 or rng.random() > self.args.run_fraction:
            return
        run_dir = os.path.join(self.work, "run")
        shutil.rmtree(run_dir, ignore_errors=True)
        argv = [self.args.dtrain, "run", case_file] + sets + [
            "--set", "train.epochs=1", "--set", "train.steps_per_epoch=2", "--set", "train.threads=1",
            "--set", "train.progress=none", "--set", "checkpoint.dir=" + os.path.join(run_dir, "ckpt"),
            "--run-dir", run_dir]
        rc, out, err, timed_out = self.execute(argv, RUN_TIMEOUT)
        self.counts["run"] += 1
        self.record(argv, text, description + " (run)", rc, out, err, timed_out, case_file)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtrain", required=True, help="the dtrain binary (the ASan build)")
    ap.add_argument("--seconds", type=float, required=True, help="stop starting cases after this long")
    ap.add_argument("--min-experiments", type=int, default=0, help="go on past --seconds (up to --max-seconds) "
                    "until this many mutated experiments have run")
    ap.add_argument("--max-seconds", type=float, default=0, help="hard cap for --min-experiments (default: "
                    "--seconds, no overtime)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True, help="directory for reproducers and scratch files")
    ap.add_argument("--run-fraction", type=float, default=0.5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.dtrain = os.path.abspath(args.dtrain)
    if not os.access(args.dtrain, os.X_OK):
        sys.exit(f"experiments.py: {args.dtrain} is not an executable")

    bases = []
    for entry in sorted(os.listdir(os.path.join(ROOT, "experiments"))):
        if entry.endswith(".yaml"):
            with open(os.path.join(ROOT, "experiments", entry), encoding="utf-8") as f:
                tree = yaml.safe_load(f)
            small_data(tree)
            bases.append((entry, tree))
    if not bases:
        sys.exit("experiments.py: no experiments/*.yaml to start from")

    rng = random.Random(args.seed)
    campaign = Campaign(args)
    start = time.monotonic()
    index = 0
    cap = max(args.seconds, args.max_seconds)
    while True:
        elapsed = time.monotonic() - start
        if elapsed >= cap or (elapsed >= args.seconds and campaign.counts["experiments"] >= args.min_experiments):
            break
        if campaign.cgroup and index % 8 == 7:
            campaign.memory_case(rng)
        else:
            campaign.case(rng, bases, index)
        index += 1
    campaign.close()
    c = campaign.counts
    met = c["experiments"] >= args.min_experiments
    print(f"experiments.py: {c['experiments']} mutated experiments ({c['set_cases']} with --set), "
          f"{c['validate']} validate and {c['run']} run invocations: {c['ok']} exit 0, {c['refused']} refused "
          f"with one error line, {c['bad']} bad, in {time.monotonic() - start:.0f} s (seed {args.seed}); "
          f"{c['memory_cases']} oversized or modest models in a {MEMORY_LIMIT >> 20} MB cgroup"
          f"{'' if campaign.cgroup else ' (none: no memory cgroup could be made here)'}")
    if args.min_experiments:
        print(f"experiments.py: target of {args.min_experiments} experiments {'met' if met else 'NOT met'}")
    for problem, n in sorted(campaign.kinds.items()):
        print(f"  {n:5d} {problem}")
    with open(os.path.join(campaign.out, "summary.json"), "w") as f:
        json.dump({"seconds": round(time.monotonic() - start), "experiments": c["experiments"],
                   "set_cases": c["set_cases"], "validate": c["validate"], "run": c["run"], "ok": c["ok"],
                   "refused": c["refused"], "bad": c["bad"], "min_experiments": args.min_experiments,
                   "targets_met": met}, f)
    sys.exit(1 if campaign.bad else 3 if not met else 0)


if __name__ == "__main__":
    main()
