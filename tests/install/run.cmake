# Installs the built project to a scratch prefix, then builds and runs tests/install against it.
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed (${rc})")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/install -B ${WORK_DIR}/build
                "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix;${TORCH_DIR}" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the outside project failed (${rc})")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the outside project failed (${rc})")
endif()
execute_process(COMMAND ${WORK_DIR}/build/uses_gpipe RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the outside program failed (${rc})")
endif()
# The Python package, installed beside the library, imports from there and runs a step.
if(PYTHON)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env PYTHONPATH=${WORK_DIR}/prefix/${PYTHON_DIR}
                  ${PYTHON} -c "import torch, gpipe, os; assert gpipe.__file__.startswith(os.environ['PYTHONPATH']), gpipe.__file__; m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)); print('installed gpipe (Python) ran a step, loss', gpipe.GPipe(m, balance=[1, 1], chunks=2).train_step(torch.randn(4, 4), torch.randn(4, 2), loss='mse'))"
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the installed Python package failed (${rc})")
  endif()
endif()
