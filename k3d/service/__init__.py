"""service: how ``k3d start`` lives as a process (daemon start-up and shutdown, sd_notify, systemd units)"""
