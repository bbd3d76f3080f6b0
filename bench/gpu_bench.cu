#include "moe_reroute/cuda.h"
int main() { return 0; }
