"""``python -m commsched.plugins.mxnet.bench``: ``commsched bench --framework mxnet`` alone."""

from commsched.plugins.mxnet.bench.strategies import main

raise SystemExit(main())
