from mili.cli import main

raise SystemExit(main())
