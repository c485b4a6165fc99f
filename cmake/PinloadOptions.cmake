# Build options and the warning/sanitizer flags every pinload target gets.
option(PINLOAD_BUILD_TESTS "Build the GoogleTest suites" ON)
option(PINLOAD_BUILD_BENCH "Build the benchmarks (needs Google Benchmark)" ON)
option(PINLOAD_WERROR "Treat warnings as errors (CI)" OFF)
option(PINLOAD_FUZZ "Build the libFuzzer targets (clang only)" OFF)
set(PINLOAD_SANITIZE "" CACHE STRING "Sanitizers: '', 'address,undefined' or 'thread'")
set(PINLOAD_WITH_CUDA AUTO CACHE STRING "CUDA device layer: AUTO, ON or OFF")
set(PINLOAD_WITH_TORCH AUTO CACHE STRING "libtorch adapter: AUTO, ON or OFF")
set(PINLOAD_WITH_PYTHON AUTO CACHE STRING "Python bindings: AUTO, ON or OFF")

if(PINLOAD_SANITIZE)
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:-fsanitize=${PINLOAD_SANITIZE};-fno-omit-frame-pointer;-fno-sanitize-recover=all>")
  add_link_options(-fsanitize=${PINLOAD_SANITIZE})
endif()

function(pinload_set_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wshadow -Wno-missing-field-initializers
                                           $<$<BOOL:${PINLOAD_WERROR}>:-Werror>)
endfunction()
