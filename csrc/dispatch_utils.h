// dtype dispatch shared by every kernel family, so the set of supported dtypes
// is stated once: float32, float16 and bfloat16 on both devices.
#pragma once

#include <ATen/Dispatch.h>

#define PYLLM_DISPATCH_CASE_FLOATING_TYPES(...)          \
  AT_DISPATCH_CASE(at::ScalarType::Float, __VA_ARGS__)   \
  AT_DISPATCH_CASE(at::ScalarType::Half, __VA_ARGS__)    \
  AT_DISPATCH_CASE(at::ScalarType::BFloat16, __VA_ARGS__)

// Inside the lambda, `scalar_t` is float, at::Half or at::BFloat16.
#define PYLLM_DISPATCH_FLOATING_TYPES(TYPE, NAME, ...) \
  AT_DISPATCH_SWITCH(TYPE, NAME, PYLLM_DISPATCH_CASE_FLOATING_TYPES(__VA_ARGS__))
