# dtrain beside TensorFlow 2.21 and Keras 3 (tests/anchors/anchors.sh): label anchors, run with
# `ctest -L anchors` after `tools/setup --anchors`. Without the anchors environment
# (build/venv-anchors) every case exits 77, which CTest counts as skipped; `ctest -LE anchors`
# leaves them out altogether.
foreach(case default mirrored multi_worker seed_default seed_mirrored seed_multi_worker varied_default varied_mirrored
             varied_multi_worker stem_default losses random keras_weights)
  add_test(NAME anchors.${case}
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/anchors/anchors.sh ${case} $<TARGET_FILE:dtrain>
                   ${CMAKE_CURRENT_BINARY_DIR}/scratch/anchors_${case}
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(anchors.${case} PROPERTIES LABELS anchors TIMEOUT 600 RUN_SERIAL TRUE SKIP_RETURN_CODE 77)
endforeach()
