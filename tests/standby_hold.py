"""A module whose import lasts until the file `RELEASE_FILE` names exists: a standby parent's imports still under
way (`tests/test_standby.py` preloads it)."""

import os
import time

while not os.path.exists(os.environ["RELEASE_FILE"]):
    time.sleep(0.01)  # the standby parent's own import, polled: no test waits on it
