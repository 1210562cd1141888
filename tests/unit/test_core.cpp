#include <doctest/doctest.h>

#include <set>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "core/tensor.hpp"

using namespace dtrain;

TEST_CASE("tensor storage is aligned, zeroed and shaped") {
  Tensor t(Shape{2, 3, 4});
  CHECK(t.numel() == 24);
  CHECK(reinterpret_cast<std::uintptr_t>(t.raw()) % Storage::alignment == 0);
  for (float v : t.span<float>()) CHECK(v == 0.0f);
  CHECK(t.shape().to_string() == "(2, 3, 4)");
  CHECK(Shape{5}.to_string() == "(5,)");
}

TEST_CASE("slice_rows shares storage") {
  Tensor t(Shape{4, 2});
  for (int i = 0; i < 8; ++i) t.data<float>()[i] = static_cast<float>(i);
  Tensor s = t.slice_rows(1, 3);
  CHECK(s.shape() == Shape{2, 2});
  CHECK(s.data<float>()[0] == 2.0f);
  s.data<float>()[0] = 42.0f;
  CHECK(t.data<float>()[2] == 42.0f);
}

TEST_CASE("view: a flat range of a tensor seen as another shape, sharing storage") {
  Tensor arena(Shape{10});
  Tensor a = arena.view(0, Shape{2, 2}), b = arena.view(4, Shape{6});
  CHECK(a.shape() == Shape{2, 2});
  CHECK(b.numel() == 6);
  b.data<float>()[0] = 7.0f;
  a.data<float>()[3] = 3.0f;
  CHECK(arena.data<float>()[4] == 7.0f);
  CHECK(arena.data<float>()[3] == 3.0f);
  CHECK(arena.view(10, Shape{0}).numel() == 0);
  CHECK_THROWS_AS(arena.view(5, Shape{6}), InternalError);
  CHECK_THROWS_AS(arena.view(-1, Shape{1}), InternalError);
}

TEST_CASE("wrong element type is an internal error, not UB") {
  Tensor t(Shape{2}, DType::u8);
  CHECK_THROWS_AS(t.data<float>(), InternalError);
}

TEST_CASE("ensure reuses storage when large enough") {
  Tensor t(Shape{8, 8});
  const void* p = t.raw();
  t.ensure(Shape{4, 8});
  CHECK(t.raw() == p);
  t.ensure(Shape{16, 8});
  CHECK(t.numel() == 128);
}

TEST_CASE("rng streams are reproducible and independent") {
  Rng a(42, RngStream::shuffle, 3), b(42, RngStream::shuffle, 3), c(42, RngStream::shuffle, 4), d(43, RngStream::shuffle, 3);
  bool differs_c = false, differs_d = false;
  for (int i = 0; i < 100; ++i) {
    auto va = a.next_u32();
    CHECK(va == b.next_u32());
    differs_c |= va != c.next_u32();
    differs_d |= va != d.next_u32();
  }
  CHECK(differs_c);
  CHECK(differs_d);
}

TEST_CASE("rng below is in range and roughly uniform") {
  Rng r(7, RngStream::test);
  int counts[10] = {};
  for (int i = 0; i < 100000; ++i) {
    auto v = r.below(10);
    REQUIRE(v < 10);
    ++counts[v];
  }
  for (int c : counts) CHECK(std::abs(c - 10000) < 500);
  double sum = 0;
  for (int i = 0; i < 100000; ++i) {
    float u = r.uniform();
    REQUIRE(u >= 0.0f);
    REQUIRE(u < 1.0f);
    sum += u;
  }
  CHECK(std::abs(sum / 100000 - 0.5) < 0.01);
}
