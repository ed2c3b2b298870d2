"""Developer tooling, not part of the runtime: nothing under kmesh outside this package imports it (a house test
holds that). The Makefile runs it on the project checkout: `python -m kmesh.devtools.lock PROFILE` (make lock)
regenerates a hash lock, `mutation_set` / `mutation_report` / `mutmut_session` run and summarise mutation testing,
`constant_checks` scans the stage code for figures typed in. It works on the project checkout
(kmesh.config.find_root: $KMESH_ROOT or the nearest directory above the working directory with config/config.yaml),
not on the installed package."""
