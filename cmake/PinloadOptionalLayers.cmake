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

set(_torch_found OFF)
pinload_resolve_layer(TORCH _torch_found)

if(PINLOAD_HAVE_CUDA)
  set(_cuda_note "device layer on CUDA ${CUDAToolkit_VERSION}")
else()
  set(_cuda_note "device layer: sim only, cuda:N throws")
endif()
message(STATUS "pinload layers: CUDA=${PINLOAD_HAVE_CUDA} (${_cuda_note}), "
               "PYTHON=${PINLOAD_HAVE_PYTHON} (pinload._core), TORCH=${PINLOAD_HAVE_TORCH} (adapter planned)")
