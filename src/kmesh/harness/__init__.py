"""The experiment harness the stages run on, not the runtime a user deploys: the write-up's workloads, a leader's
export, a child request end to end (over kmesh.kv's load step), a model process as a client of a real cache service,
and a service under a controller's thumb (paced copies, worker processes, leak checks from outside)."""
