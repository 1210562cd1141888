# Integration tests: the real dtrain binary on real files (tests/integration/cli.sh CASE ...).
set(DTRAIN_CLI_CASES
  help info validate train_small validation_split deterministic regression_toy
  bad_unknown_key bad_type bad_data_dir bad_idx_truncated bad_idx_magic bad_hdf5
  experiments_validate train_mirrored refused_reduction nccl_on_cpu gpu_refused rerun_refused
  limits)
foreach(case ${DTRAIN_CLI_CASES})
  add_test(NAME cli.${case}
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/integration/cli.sh ${case} $<TARGET_FILE:dtrain>
                   ${CMAKE_CURRENT_BINARY_DIR}/scratch/${case}
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(cli.${case} PROPERTIES TIMEOUT 600)
endforeach()
# Each training test uses both cores: running two at once only makes both slower.
set_tests_properties(cli.train_small cli.validation_split cli.deterministic cli.train_mirrored PROPERTIES RUN_SERIAL TRUE)

# Checkpoints, eval and exact resume (tests/integration/checkpoint.sh CASE ...). They train, and
# the kill/resume ones compare bits with a reference run: run them one at a time.
set(DTRAIN_CHECKPOINT_CASES kill9_resume sigterm_resume sigint_resume eval_matches_training eval_bn_dropout
    across_strategies
    truncated_checkpoint)
foreach(case ${DTRAIN_CHECKPOINT_CASES})
  add_test(NAME checkpoint.${case}
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/integration/checkpoint.sh ${case} $<TARGET_FILE:dtrain>
                   ${CMAKE_CURRENT_BINARY_DIR}/scratch/checkpoint_${case}
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(checkpoint.${case} PROPERTIES TIMEOUT 600 RUN_SERIAL TRUE)
endforeach()

# MultiWorkerMirrored over real mpirun with 2 and 4 ranks (tests/integration/multi_worker.sh).
set(DTRAIN_MPI_CASES equivalence sync_batch_norm exact_eval sharding roles resume_other_world regularization overlap kill_rank watchdog
    uneven)
foreach(case ${DTRAIN_MPI_CASES})
  add_test(NAME mpi.${case}
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/integration/multi_worker.sh ${case} $<TARGET_FILE:dtrain>
                   ${CMAKE_CURRENT_BINARY_DIR}/scratch/mpi_${case}
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(mpi.${case} PROPERTIES TIMEOUT 600 RUN_SERIAL TRUE)
endforeach()

# The modules stay layered: no include from a lower module to a higher one (tools/check_layering).
add_test(NAME layering COMMAND python3 ${PROJECT_SOURCE_DIR}/tools/check_layering)
