# Sanitizer and fuzzer instrumentation for every target defined after this
# file is included. MOE_REROUTE_SANITIZE is a comma-separated -fsanitize= list,
# e.g. "address,undefined" or "thread"; empty means none.
#
# TSan needs clang: libgomp is not instrumented, so TSan reports its barriers
# as races. clang's -fopenmp uses libomp, which loads its Archer tool under
# TSan to tell TSan about OpenMP synchronisation; run the tests with
# TSAN_OPTIONS=ignore_noninstrumented_modules=1 (scripts/hardening.sh does)
# so the uninstrumented libomp itself is not reported either.

option(MOE_REROUTE_FUZZ "Build the libFuzzer targets in tests/fuzz (clang only)" OFF)

if(MOE_REROUTE_SANITIZE)
  string(REPLACE "," ";" _moe_reroute_sanitizers "${MOE_REROUTE_SANITIZE}")
  foreach(_sanitizer IN LISTS _moe_reroute_sanitizers)
    if(NOT _sanitizer MATCHES "^(address|undefined|thread|leak)$")
      message(FATAL_ERROR "MOE_REROUTE_SANITIZE: unknown sanitizer '${_sanitizer}' "
                          "(use address, undefined, thread or leak)")
    endif()
  endforeach()
  if("thread" IN_LIST _moe_reroute_sanitizers AND "address" IN_LIST _moe_reroute_sanitizers)
    message(FATAL_ERROR "MOE_REROUTE_SANITIZE: thread and address cannot be combined")
  endif()
  if("thread" IN_LIST _moe_reroute_sanitizers AND NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "MOE_REROUTE_SANITIZE=thread needs clang (libomp): libgomp is not "
                        "TSan-instrumented and reports false races")
  endif()
  set(_moe_reroute_sanitize_flags -fsanitize=${MOE_REROUTE_SANITIZE} -fno-omit-frame-pointer)
  if("undefined" IN_LIST _moe_reroute_sanitizers)
    # Make every UBSan report fatal, so a test fails instead of printing and passing.
    list(APPEND _moe_reroute_sanitize_flags -fno-sanitize-recover=all)
  endif()
  # CXX only: a CUDA build must not hand these to nvcc. -g1: line tables, so
  # reports name file and line, at a fraction of full debug info's build time.
  foreach(_flag IN LISTS _moe_reroute_sanitize_flags ITEMS -g1)
    add_compile_options($<$<COMPILE_LANGUAGE:CXX>:${_flag}>)
  endforeach()
  add_link_options(${_moe_reroute_sanitize_flags})
endif()

if(MOE_REROUTE_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "MOE_REROUTE_FUZZ needs clang (libFuzzer)")
  endif()
  # Coverage for the fuzzer everywhere; only the fuzz targets link its main().
  add_compile_options($<$<COMPILE_LANGUAGE:CXX>:-fsanitize=fuzzer-no-link>)
endif()
