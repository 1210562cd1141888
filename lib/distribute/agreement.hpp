// Agreement on a set-up step that bad input may fail (loading the experiment, the data), across
// the processes of a job, before any of them goes on to a collective the others would never join.
#pragma once

#include <functional>
#include <string>

#include "distribute/communicator.hpp"

namespace dtrain::distribute {

// Runs `step` on every participant of `job` (each calls this at the same point) and agrees on
// whether it failed (ConfigError or InputError; anything else escapes as it is):
//  - nowhere: returns;
//  - everywhere with one error (one file every process reads): each throws JobConfigError with it,
//    and the chief alone reports it; everywhere with different errors (each one's own files): each
//    throws its own marked per_rank, and reports it with its rank;
//  - on some (files of their own, a path missing on one host): those throw JobConfigError marked
//    per_rank with their error, each reporting it with its rank, and the others a JobConfigError
//    saying that other ranks failed `what`.
// No process is left waiting in a collective, so the job ends without an abort. `what` names the
// step for the watchdog and the messages ("loading the data").
void agree_on_every_worker(Communicator& job, const char* what, const std::function<void()>& step);

// Whether every participant of `job` holds the same `value` (compared by a digest of it; each
// calls this at the same point). `what` names the collective for the watchdog.
bool same_on_every_worker(Communicator& job, const std::string& value, const char* what);

}  // namespace dtrain::distribute
