"""An outside team's torchrec DLRM, trained through the deltarec pipeline (see README.md)."""
