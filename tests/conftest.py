import os

import pytest
import torch

# Keep spawned ranks from oversubscribing the CI machine's 2 cores.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
