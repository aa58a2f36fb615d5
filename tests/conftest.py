import os

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run (a test command that passes passes again);
# HYPOTHESIS_PROFILE=explore draws new ones, to look for inputs the fixed draw misses.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

# Keep spawned ranks from oversubscribing the CI machine's 2 cores.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
