// Everything public in meshfuse.
#pragma once

#include "meshfuse/core/device.h"
#include "meshfuse/core/dtype.h"
#include "meshfuse/core/error.h"
#include "meshfuse/core/kernel_backend.h"
#include "meshfuse/core/platform.h"
#include "meshfuse/core/stream.h"
#include "meshfuse/core/tensor.h"
#include "meshfuse/ops/continuous_count.h"
#include "meshfuse/ops/cross_entropy.h"
#include "meshfuse/ops/fused_linear_cross_entropy.h"
#include "meshfuse/ops/gemm.h"
#include "meshfuse/ops/pack_sequence.h"
#include "meshfuse/ops/recurrent.h"
#include "meshfuse/ops/rmsnorm.h"
#include "meshfuse/ops/softmax.h"
#include "meshfuse/ops/swiglu.h"
