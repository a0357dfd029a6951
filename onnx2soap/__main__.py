from onnx2soap.cli import main

raise SystemExit(main())
