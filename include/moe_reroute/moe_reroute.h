#pragma once

/// The whole public API.

#include "moe_reroute/dtype.h"
#include "moe_reroute/error.h"
#include "moe_reroute/operator.h"
#include "moe_reroute/reroute.h"
#include "moe_reroute/routing.h"
#include "moe_reroute/tensor.h"
#include "moe_reroute/version.h"
