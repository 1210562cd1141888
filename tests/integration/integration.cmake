# Integration tests: the real dtrain binary on real files (tests/integration/cli.sh CASE ...).
set(DTRAIN_CLI_CASES
  help info validate train_small validation_split deterministic regression_toy
  bad_unknown_key bad_type bad_data_dir bad_idx_truncated bad_idx_magic bad_hdf5
  experiments_validate train_mirrored refused_reduction nccl_on_cpu gpu_refused cuda_on_demand rerun_refused bf16_refused
  limits bn_first_short_batch order)
foreach(case ${DTRAIN_CLI_CASES})
  add_test(NAME cli.${case}
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/integration/cli.sh ${case} $<TARGET_FILE:dtrain>
                   ${CMAKE_CURRENT_BINARY_DIR}/scratch/${case}
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(cli.${case} PROPERTIES TIMEOUT 600 SKIP_RETURN_CODE 77)
endforeach()
# Each training test uses both cores: running two at once only makes both slower.
set_tests_properties(cli.train_small cli.validation_split cli.deterministic cli.train_mirrored PROPERTIES RUN_SERIAL TRUE)

# Checkpoints, eval and exact resume (tests/integration/checkpoint.sh CASE ...). They train, and
# the kill/resume ones compare bits with a reference run: run them one at a time.
set(DTRAIN_CHECKPOINT_CASES kill9_resume sigterm_resume sigint_resume eval_matches_training eval_bn_dropout
    across_strategies
    truncated_checkpoint bf16_resume)
foreach(case ${DTRAIN_CHECKPOINT_CASES})
  add_test(NAME checkpoint.${case}
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/integration/checkpoint.sh ${case} $<TARGET_FILE:dtrain>
                   ${CMAKE_CURRENT_BINARY_DIR}/scratch/checkpoint_${case}
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(checkpoint.${case} PROPERTIES TIMEOUT 600 RUN_SERIAL TRUE SKIP_RETURN_CODE 77)
endforeach()

# MultiWorkerMirrored over real mpirun with 2 and 4 ranks (tests/integration/multi_worker.sh).
set(DTRAIN_MPI_CASES equivalence mixed_bfloat16 sync_batch_norm exact_eval sharding file_shards roles resume_other_world regularization overlap kill_rank watchdog
    uneven tiny_batch)
foreach(case ${DTRAIN_MPI_CASES})
  add_test(NAME mpi.${case}
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/integration/multi_worker.sh ${case} $<TARGET_FILE:dtrain>
                   ${CMAKE_CURRENT_BINARY_DIR}/scratch/mpi_${case}
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(mpi.${case} PROPERTIES TIMEOUT 600 RUN_SERIAL TRUE SKIP_RETURN_CODE 77)
endforeach()

# The modules stay layered: no include from a lower module to a higher one (tools/check_layering).
add_test(NAME layering COMMAND python3 ${PROJECT_SOURCE_DIR}/tools/check_layering)

# Cases of tests/integration/SCRIPT.sh, each a CTest test SCRIPT.CASE run one at a time.
function(dtrain_script_cases script)
  foreach(case ${ARGN})
    add_test(NAME ${script}.${case}
             COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/integration/${script}.sh ${case} $<TARGET_FILE:dtrain>
                     ${CMAKE_CURRENT_BINARY_DIR}/scratch/${script}_${case}
             WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(${script}.${case} PROPERTIES TIMEOUT 300 RUN_SERIAL TRUE)
  endforeach()
endfunction()
# train.tensorboard's event files read back with Python's protobuf, and tools/to_hdf5 from
# generated images, CSV and NumPy files to a dtrain run.
dtrain_script_cases(tensorboard events_match_metrics resume chief_only read_by_tensorboard)
# Every strategy with the CPU backend's memory inaccessible outside its calls (the memory seam).
dtrain_script_cases(checked_memory one_process multi_worker resume parameter_server)
dtrain_script_cases(to_hdf5 convert_and_train bad_inputs png_16bit csv_class_names)
# reproducibility: replica_invariant: the same bits under every layout, and an elastic resume.
dtrain_script_cases(reproducibility one_process multi_worker elastic_resume elastic_batch_keys pinned_isa refusals loss_figure)
# Logs under mpirun, dtrain init, dtrain plot and train.plot (tests/integration/ux.sh).
set(DTRAIN_UX_CASES mpi_log bar_on_terminal init_strategies init_default_trains init_overwrite plot plot_errors train_plot
    local_strategy_under_mpirun)
foreach(case ${DTRAIN_UX_CASES})
  add_test(NAME ux.${case}
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/integration/ux.sh ${case} $<TARGET_FILE:dtrain>
                   ${CMAKE_CURRENT_BINARY_DIR}/scratch/ux_${case}
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(ux.${case} PROPERTIES TIMEOUT 300)
endforeach()
set_tests_properties(ux.mpi_log ux.init_strategies ux.local_strategy_under_mpirun PROPERTIES RUN_SERIAL TRUE)
# ParameterServerStrategy over real mpirun with 3 to 5 ranks (tests/integration/parameter_server.sh).
dtrain_script_cases(parameter_server sync_equals_default async roles sigterm lost_worker lost_at_the_end lost_mid_push
                    lost_exit_codes lost_ps lost_coordinator)
# dtrain export: ONNX Runtime (build/venv, tools/setup) against dtrain eval, every layer kind and
# the strategies' checkpoints; --format keras and model.initial_weights reading it back.
dtrain_script_cases(export layer_kinds strategies errors keras)
# dtrain bench: the table and the JSON, in one process and under mpirun -n 2.
dtrain_script_cases(bench table_and_json bad_args mpi)
# Bad files, full and read-only disks, damaged checkpoints and manifests, signals under mpirun
# (tests/integration/files.sh CASE ...). The disk cases mount a tmpfs and are skipped (exit 77)
# where that is not permitted.
set(DTRAIN_FILES_CASES full_disk readonly_run_dir unwritable_checkpoint_dir nan_data data_beyond_memory idx_labels special_files manifest
    resume_checkpoint_dir relative_checkpoint_dir shared_checkpoint_dir branched_resume metrics_once diverged damaged_state stored_experiment
    double_signal signal_after_command mpi_signals)
foreach(case ${DTRAIN_FILES_CASES})
  add_test(NAME files.${case}
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/integration/files.sh ${case} $<TARGET_FILE:dtrain>
                   ${CMAKE_CURRENT_BINARY_DIR}/scratch/files_${case}
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(files.${case} PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77)
endforeach()
set_tests_properties(files.double_signal files.mpi_signals PROPERTIES RUN_SERIAL TRUE)
# Multi-host over real TCP, with faults (tests/integration/multihost.sh): 2 to 4 hosts made as
# network namespaces (tools/netns_hosts), mpirun across them; a link cut, a killed host, netem
# latency and loss. Needs root (CI is); elsewhere, and without sch_netem for latency, exit 77.
set(DTRAIN_MULTIHOST_CASES equivalence link_cut killed_host latency)
foreach(case ${DTRAIN_MULTIHOST_CASES})
  add_test(NAME multihost.${case}
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/integration/multihost.sh ${case} $<TARGET_FILE:dtrain>
                   ${CMAKE_CURRENT_BINARY_DIR}/scratch/multihost_${case}
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(multihost.${case} PROPERTIES TIMEOUT 300 RUN_SERIAL TRUE SKIP_RETURN_CODE 77 LABELS multihost)
endforeach()
