# Installs the build tree into a scratch prefix, then configures, builds and
# runs tests/consumer against it with find_package(pinload CONFIG).
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(rc)
  message(FATAL_ERROR "install failed: ${rc}")
endif()
# TORCH_PREFIX (set where pinload has the torch adapter): torch's CMake prefix;
# the consumer must then find pinload::torch and build examples/load_to_torch.cc.
set(prefix_path "${WORK_DIR}/prefix")
set(torch_args -DWITH_TORCH=OFF)
if(TORCH_PREFIX)
  list(APPEND prefix_path "${TORCH_PREFIX}")
  # No TORCH_CUDA_ARCH_LIST or other flag: COMPONENTS torch works with a CUDA torch as documented.
  set(torch_args -DWITH_TORCH=ON -DEXAMPLES_DIR=${EXAMPLES_DIR})
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/build -G Ninja
                        "-DCMAKE_PREFIX_PATH=${prefix_path}" ${torch_args} RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configure failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "build failed: ${rc}")
endif()
foreach(app app app_core)
  execute_process(COMMAND ${WORK_DIR}/build/${app} RESULT_VARIABLE rc OUTPUT_VARIABLE out)
  message(STATUS "${app}: ${out}")
  if(NOT out MATCHES "consumer ok")
    message(FATAL_ERROR "${app} did not run: ${rc}")
  endif()
endforeach()
if(TORCH_PREFIX)
  # The example loads a checkpoint the tests wrote; any checkpoint proves it links and runs.
  execute_process(COMMAND ${WORK_DIR}/build/torch_example ${CHECKPOINT} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  message(STATUS "${out}${err}")
  if(rc)
    message(FATAL_ERROR "the torch example failed: ${rc}")
  endif()
endif()
