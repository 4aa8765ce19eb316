"""`python -m jax_api`: the installation self-check (`jax_api.selfcheck`)."""

import sys

from jax_api.selfcheck import main

if __name__ == "__main__":
  sys.exit(main())
