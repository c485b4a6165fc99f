# The CUDA, libtorch and Python layers switch on when their dependency is
# found (AUTO), are forced (ON), or are skipped (OFF). Each later layer adds
# its targets here.
function(pinload_resolve_layer name found)
  if(PINLOAD_WITH_${name} STREQUAL "ON" AND NOT ${found})
    message(FATAL_ERROR "PINLOAD_WITH_${name}=ON but its dependency was not found")
  endif()
  if(PINLOAD_WITH_${name} STREQUAL "OFF" OR NOT ${found})
    set(PINLOAD_HAVE_${name} OFF PARENT_SCOPE)
  else()
    set(PINLOAD_HAVE_${name} ON PARENT_SCOPE)
  endif()
endfunction()

set(_cuda_found OFF)
if(NOT PINLOAD_WITH_CUDA STREQUAL "OFF")
  find_package(CUDAToolkit QUIET)
  set(_cuda_found ${CUDAToolkit_FOUND})
endif()
pinload_resolve_layer(CUDA _cuda_found)

set(_python_found OFF)
if(NOT PINLOAD_WITH_PYTHON STREQUAL "OFF")
  find_package(Python3 QUIET COMPONENTS Interpreter Development.Module)
  find_package(pybind11 CONFIG QUIET)
  if(Python3_FOUND AND pybind11_FOUND)
    set(_python_found ON)
  endif()
endif()
pinload_resolve_layer(PYTHON _python_found)

# libtorch comes from the Python torch package: one interpreter call asks for
# its CMake prefix, the CUDA version it was built with and its C++ ABI.
set(_torch_found OFF)
if(NOT PINLOAD_WITH_TORCH STREQUAL "OFF")
  find_package(Python3 QUIET COMPONENTS Interpreter)
  if(Python3_Interpreter_FOUND)
    execute_process(
      COMMAND ${Python3_EXECUTABLE} -c
              "import torch, torch.utils; print(torch.utils.cmake_prefix_path); print(torch.version.cuda or ''); print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
      RESULT_VARIABLE _torch_rc OUTPUT_VARIABLE _torch_out ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(_torch_rc EQUAL 0)
      string(REPLACE "\n" ";" _torch_out "${_torch_out}")
      list(GET _torch_out 0 _torch_prefix)
      list(GET _torch_out 1 PINLOAD_TORCH_CUDA_VERSION)
      list(GET _torch_out 2 _torch_cxx11_abi)
      list(APPEND CMAKE_PREFIX_PATH "${_torch_prefix}")
      # A CUDA torch's config picks nvcc -gencode flags and, without an arch
      # list, compiles and runs a GPU probe (which fails without a GPU, and
      # with CMake < 3.26 before that). pinload compiles no device code, so
      # any list will do.
      if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
        set(TORCH_CUDA_ARCH_LIST "9.0")
      endif()
      if(_torch_cxx11_abi EQUAL 1)
        find_package(Torch CONFIG QUIET)
        set(_torch_found ${Torch_FOUND})
      else()
        # pinload::core is built with the default (cxx11) std::string ABI; a
        # pre-cxx11-ABI torch could not share std::string with it.
        message(STATUS "pinload: skipping the torch adapter: torch uses the pre-cxx11 ABI")
      endif()
    endif()
  endif()
endif()
pinload_resolve_layer(TORCH _torch_found)
if(PINLOAD_HAVE_TORCH AND PINLOAD_HAVE_CUDA AND PINLOAD_TORCH_CUDA_VERSION)
  string(REGEX MATCH "^[0-9]+" _torch_cuda_major "${PINLOAD_TORCH_CUDA_VERSION}")
  if(NOT _torch_cuda_major STREQUAL CUDAToolkit_VERSION_MAJOR)
    message(FATAL_ERROR "torch was built with CUDA ${PINLOAD_TORCH_CUDA_VERSION} but the CUDA toolkit found is "
                        "${CUDAToolkit_VERSION}: the major versions must match (install the matching torch wheel, "
                        "point CUDAToolkit_ROOT at CUDA ${_torch_cuda_major}, or set PINLOAD_WITH_TORCH=OFF)")
  endif()
endif()

if(PINLOAD_HAVE_CUDA)
  set(_cuda_note "device layer on CUDA ${CUDAToolkit_VERSION}")
else()
  set(_cuda_note "device layer: sim only, cuda:N throws")
endif()
message(STATUS "pinload layers: CUDA=${PINLOAD_HAVE_CUDA} (${_cuda_note}), "
               "PYTHON=${PINLOAD_HAVE_PYTHON} (pinload._core), TORCH=${PINLOAD_HAVE_TORCH} (pinload::torch)")
