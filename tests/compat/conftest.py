import sys
from pathlib import Path

# harness.py and victim.py are imported by name (the victim also runs as a script)
HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
