"""What a process knows of its job before the first op: settings, ranks and hosts, addresses, the names of its files, its log format."""
