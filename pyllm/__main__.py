import sys

from pyllm.cli import main

sys.exit(main())
