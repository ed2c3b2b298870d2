"""The project's own tooling that the Makefile runs, as package code: `python -m kmesh.tools.lock PROFILE`
(make lock) regenerates a hash lock, `python -m kmesh.tools.mutation_report` (make mutation) summarises mutmut's
last run. Both work on the project checkout (kmesh.config.find_root: $KMESH_ROOT or the nearest directory above
the working directory with config/config.yaml), not on the installed package."""
