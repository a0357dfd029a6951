from executor.cli import main

raise SystemExit(main())
