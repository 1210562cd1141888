// Reducer: sums one replica's gradients with every other worker's, during or after backward
// (the role of PyTorch DDP's Reducer). The replica's gradients are one contiguous arena of
// variables (nn::Sequential::gradient_arena); backward hands each layer's finished variables over
// with ready(), last layer first, and finish() returns when the whole arena holds the sum over the
// workers. A reducer that does not overlap ignores ready() and sums everything in finish().
#pragma once

#include <cstddef>

namespace dtrain::distribute {

class Reducer {
 public:
  virtual ~Reducer() = default;
  // Whether sums start during backward (on ready()) rather than in finish().
  virtual bool overlaps() const = 0;
  // Variables [first, first + count) hold their final gradients for this step.
  virtual void ready(std::size_t first, std::size_t count) = 0;
  // Returns when every variable holds the sum over the workers; rethrows a failure of the sums.
  virtual void finish() = 0;
  // Whether sums of this step may be under way on another thread (between the first ready() and
  // finish()): nothing else may call into the workers' group then.
  virtual bool in_flight() = 0;
  // Seconds since the last take: inside the collectives, and blocked in finish() waiting for them
  // (without overlap the two are the same).
  virtual double take_collective_seconds() = 0;
  virtual double take_wait_seconds() = 0;
};

}  // namespace dtrain::distribute
