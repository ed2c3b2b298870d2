from kmesh.cli import main

raise SystemExit(main())
