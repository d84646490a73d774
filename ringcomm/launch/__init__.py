"""The launcher and what it starts: `ringcomm-run`'s command line, host plans, worker supervision, the parent guard, remote starts, the elastic driver, `ringcomm.run()` and Ray."""
