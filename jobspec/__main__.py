from jobspec.cli import main

raise SystemExit(main())
