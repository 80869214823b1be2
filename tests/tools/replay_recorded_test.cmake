# Replays a recorded PyTorch trace (tests/data/traces, made on an H200 with
# tools/gpu/record_traces.py) under a capacity just below what PyTorch's allocators need (its
# caching allocator 2.00 GiB, expandable segments 1.94 GiB): gpustitch must run it without
# out-of-memory, while both PyTorch models fail.
execute_process(COMMAND ${GPUSTITCH} replay ${TRACE} --capacity-gb ${CAPACITY_GB} --json
                OUTPUT_VARIABLE out RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "gpustitch replay exited with ${rc}")
endif()
string(JSON n LENGTH "${out}" policies)
math(EXPR last "${n} - 1")
foreach(i RANGE ${last})
  string(JSON name GET "${out}" policies ${i} policy)
  string(JSON ooms GET "${out}" policies ${i} ooms)
  set(ooms_${name} ${ooms})
endforeach()
if(NOT DEFINED ooms_gpustitch OR NOT ooms_gpustitch EQUAL 0)
  message(FATAL_ERROR "gpustitch must replay without OOM at ${CAPACITY_GB} GiB:\n${out}")
endif()
if(ooms_expandable-segments EQUAL 0 OR ooms_pytorch EQUAL 0)
  message(FATAL_ERROR "expected OOMs under both PyTorch models:\n${out}")
endif()
