"""``horovod.runner.util``: the helpers of Horovod's runner that scripts and test suites import."""
