// Per-channel kernels for benchmarks/native_batch_norm.py: what a
// synchronised batch-norm layer would cost on CPU towers with kernels of
// its own (an experiment; the library does not use them).
//
// Channels-last float32 tensors, viewed as [rows, channels]. Each kernel is
// one pass over its inputs, on one thread: the towers run side by side.
// Sums run in float over blocks of rows and in double across blocks.

#include <algorithm>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace replicate_benchmark {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::shape_inference::InferenceContext;

constexpr int64_t kBlockRows = 64;

::tensorflow::Status TwoChannelVectors(InferenceContext* c) {
  auto channels = c->Dim(c->input(0), -1);
  c->set_output(0, c->Vector(channels));
  c->set_output(1, c->Vector(channels));
  return ::tensorflow::OkStatus();
}

REGISTER_OP("ReplicateBenchmarkMoments")
    .Input("x: float")
    .Output("mean: float")
    .Output("squared_distances: float")
    .SetShapeFn(TwoChannelVectors)
    .Doc("Per channel: the mean of x and the sum of (x - mean)^2.");

REGISTER_OP("ReplicateBenchmarkNormalizeRelu")
    .Input("x: float")
    .Input("scale: float")
    .Input("offset: float")
    .Output("y: float")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      return ::tensorflow::OkStatus();
    })
    .Doc("Per channel: max(scale * x + offset, 0).");

// With `relu`, dy is the gradient of NormalizeRelu's output: it counts
// where scale * x + offset > 0 (the forward's own arithmetic: the same
// elements), as ReluGrad would pass it. Without, scale and offset are
// unused.
REGISTER_OP("ReplicateBenchmarkGradientSums")
    .Input("dy: float")
    .Input("x: float")
    .Input("mean: float")
    .Input("scale: float")
    .Input("offset: float")
    .Attr("relu: bool")
    .Output("sum_dy: float")
    .Output("sum_dy_centred: float")
    .SetShapeFn(TwoChannelVectors)
    .Doc("Per channel: sum(dy) and sum(dy * (x - mean)).");

REGISTER_OP("ReplicateBenchmarkAffine")
    .Input("dy: float")
    .Input("x: float")
    .Input("a: float")
    .Input("b: float")
    .Input("c: float")
    .Input("scale: float")
    .Input("offset: float")
    .Attr("relu: bool")
    .Output("dx: float")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      return ::tensorflow::OkStatus();
    })
    .Doc("Per channel: a * dy + b * x + c.");

// Rows and channels of a channels-last tensor; false (the op failed) for
// a tensor of rank < 2.
bool RowsAndChannels(OpKernelContext* context, const Tensor& x,
                     int64_t* rows, int64_t* channels) {
  if (x.dims() < 2) {
    context->SetStatus(::tensorflow::errors::InvalidArgument(
        "expected a channels-last tensor of rank >= 2, got shape ",
        x.shape().DebugString()));
    return false;
  }
  *channels = x.dim_size(x.dims() - 1);
  *rows = *channels ? x.NumElements() / *channels : 0;
  return true;
}

// Per channel, adds up what `f(row, first, second)` adds to `first` and
// `second` for each row: in float over a block, in double across blocks.
template <typename F>
void SumRows(int64_t rows, int64_t channels, F f, std::vector<double>* first,
             std::vector<double>* second) {
  std::vector<float> block_first(channels), block_second(channels);
  for (int64_t start = 0; start < rows; start += kBlockRows) {
    std::fill(block_first.begin(), block_first.end(), 0.0f);
    std::fill(block_second.begin(), block_second.end(), 0.0f);
    const int64_t end = std::min(rows, start + kBlockRows);
    for (int64_t r = start; r < end; ++r) {
      f(r, block_first.data(), block_second.data());
    }
    for (int64_t k = 0; k < channels; ++k) {
      (*first)[k] += block_first[k];
      (*second)[k] += block_second[k];
    }
  }
}

class MomentsOp : public OpKernel {
 public:
  explicit MomentsOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& x = context->input(0);
    int64_t rows, channels;
    if (!RowsAndChannels(context, x, &rows, &channels)) return;
    Tensor *mean, *squared;
    OP_REQUIRES_OK(context, context->allocate_output(
                                0, TensorShape({channels}), &mean));
    OP_REQUIRES_OK(context, context->allocate_output(
                                1, TensorShape({channels}), &squared));
    const float* __restrict data = x.flat<float>().data();
    std::vector<double> sums(channels, 0.0), squares(channels, 0.0);
    SumRows(rows, channels,
            [&](int64_t r, float* s, float* q) {
              const float* row = data + r * channels;
              for (int64_t k = 0; k < channels; ++k) {
                s[k] += row[k];
                q[k] += row[k] * row[k];
              }
            },
            &sums, &squares);
    auto mean_out = mean->flat<float>();
    auto squared_out = squared->flat<float>();
    for (int64_t k = 0; k < channels; ++k) {
      const double m = rows ? sums[k] / rows : 0.0;
      mean_out(k) = m;
      squared_out(k) = std::max(squares[k] - sums[k] * m, 0.0);
    }
  }
};

class NormalizeReluOp : public OpKernel {
 public:
  explicit NormalizeReluOp(OpKernelConstruction* context)
      : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& x = context->input(0);
    int64_t rows, channels;
    if (!RowsAndChannels(context, x, &rows, &channels)) return;
    Tensor* y;
    OP_REQUIRES_OK(context, context->allocate_output(0, x.shape(), &y));
    const float* __restrict scale = context->input(1).flat<float>().data();
    const float* __restrict offset = context->input(2).flat<float>().data();
    const float* __restrict data = x.flat<float>().data();
    float* __restrict out = y->flat<float>().data();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t start = r * channels;
      for (int64_t k = 0; k < channels; ++k) {
        out[start + k] = std::max(scale[k] * data[start + k] + offset[k], 0.0f);
      }
    }
  }
};

class GradientSumsOp : public OpKernel {
 public:
  explicit GradientSumsOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("relu", &relu_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& dy = context->input(0);
    const Tensor& x = context->input(1);
    int64_t rows, channels;
    if (!RowsAndChannels(context, x, &rows, &channels)) return;
    Tensor *sum_dy, *sum_centred;
    OP_REQUIRES_OK(context, context->allocate_output(
                                0, TensorShape({channels}), &sum_dy));
    OP_REQUIRES_OK(context, context->allocate_output(
                                1, TensorShape({channels}), &sum_centred));
    const float* __restrict g = dy.flat<float>().data();
    const float* __restrict data = x.flat<float>().data();
    const float* __restrict mean = context->input(2).flat<float>().data();
    const float* __restrict scale = context->input(3).flat<float>().data();
    const float* __restrict offset = context->input(4).flat<float>().data();
    std::vector<double> first(channels, 0.0), second(channels, 0.0);
    if (relu_) {
      SumRows(rows, channels,
              [&](int64_t r, float* s, float* q) {
                const float* g_row = g + r * channels;
                const float* x_row = data + r * channels;
                for (int64_t k = 0; k < channels; ++k) {
                  const float on = scale[k] * x_row[k] + offset[k] > 0.0f;
                  s[k] += on * g_row[k];
                  q[k] += on * g_row[k] * (x_row[k] - mean[k]);
                }
              },
              &first, &second);
    } else {
      SumRows(rows, channels,
              [&](int64_t r, float* s, float* q) {
                const float* g_row = g + r * channels;
                const float* x_row = data + r * channels;
                for (int64_t k = 0; k < channels; ++k) {
                  s[k] += g_row[k];
                  q[k] += g_row[k] * (x_row[k] - mean[k]);
                }
              },
              &first, &second);
    }
    std::copy(first.begin(), first.end(), sum_dy->flat<float>().data());
    std::copy(second.begin(), second.end(), sum_centred->flat<float>().data());
  }

 private:
  bool relu_;
};

class AffineOp : public OpKernel {
 public:
  explicit AffineOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("relu", &relu_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& dy = context->input(0);
    const Tensor& x = context->input(1);
    int64_t rows, channels;
    if (!RowsAndChannels(context, x, &rows, &channels)) return;
    Tensor* dx;
    OP_REQUIRES_OK(context, context->allocate_output(0, dy.shape(), &dx));
    const float* __restrict a = context->input(2).flat<float>().data();
    const float* __restrict b = context->input(3).flat<float>().data();
    const float* __restrict c = context->input(4).flat<float>().data();
    const float* __restrict scale = context->input(5).flat<float>().data();
    const float* __restrict offset = context->input(6).flat<float>().data();
    const float* __restrict g = dy.flat<float>().data();
    const float* __restrict data = x.flat<float>().data();
    float* __restrict out = dx->flat<float>().data();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t start = r * channels;
      if (relu_) {
        for (int64_t k = 0; k < channels; ++k) {
          const float x_k = data[start + k];
          const float on = scale[k] * x_k + offset[k] > 0.0f;
          out[start + k] = a[k] * on * g[start + k] + b[k] * x_k + c[k];
        }
      } else {
        for (int64_t k = 0; k < channels; ++k) {
          out[start + k] = a[k] * g[start + k] + b[k] * data[start + k] + c[k];
        }
      }
    }
  }

 private:
  bool relu_;
};

REGISTER_KERNEL_BUILDER(
    Name("ReplicateBenchmarkMoments").Device(::tensorflow::DEVICE_CPU),
    MomentsOp);
REGISTER_KERNEL_BUILDER(
    Name("ReplicateBenchmarkNormalizeRelu").Device(::tensorflow::DEVICE_CPU),
    NormalizeReluOp);
REGISTER_KERNEL_BUILDER(
    Name("ReplicateBenchmarkGradientSums").Device(::tensorflow::DEVICE_CPU),
    GradientSumsOp);
REGISTER_KERNEL_BUILDER(
    Name("ReplicateBenchmarkAffine").Device(::tensorflow::DEVICE_CPU),
    AffineOp);

}  // namespace replicate_benchmark
