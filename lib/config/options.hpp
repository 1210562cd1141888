// One layer's or one strategy's options, whatever its kind. Each layer file in nn/ defines its own
// options struct (Conv2DOptions, DenseOptions, ...) and its schema (config/layers.hpp), and so does
// each strategy file in distribute/ (MirroredOptions, ...; config/strategies.hpp); the experiment
// holds them type-erased here, so that adding a layer or a strategy kind never touches config/.
//
// Value semantics: copies share the immutable options; == compares kinds and values (the option
// structs define a defaulted ==).
#pragma once

#include <memory>
#include <typeinfo>
#include <utility>

namespace dtrain::config {

class Options {
 public:
  Options() = default;
  template <class T>
  Options(T options)  // NOLINT(google-explicit-constructor): options structs convert implicitly
      : impl_(std::make_shared<const Holder<T>>(std::move(options))) {}

  bool has_value() const { return impl_ != nullptr; }
  // The options when they are a T, else null.
  template <class T>
  const T* get_if() const {
    if (!impl_ || impl_->type() != typeid(T)) return nullptr;
    return &static_cast<const Holder<T>&>(*impl_).value;
  }
  bool operator==(const Options& other) const {
    if (!impl_ || !other.impl_) return impl_ == other.impl_;
    return impl_->type() == other.impl_->type() && impl_->equals(*other.impl_);
  }

 private:
  struct Base {
    virtual ~Base() = default;
    virtual const std::type_info& type() const = 0;
    virtual bool equals(const Base& other) const = 0;  // `other` holds the same type
  };
  template <class T>
  struct Holder final : Base {
    explicit Holder(T v) : value(std::move(v)) {}
    const std::type_info& type() const override { return typeid(T); }
    bool equals(const Base& other) const override { return value == static_cast<const Holder&>(other).value; }
    T value;
  };
  std::shared_ptr<const Base> impl_;
};

}  // namespace dtrain::config
