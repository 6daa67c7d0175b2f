-- the hub's own database beside the broker's (run once, when the data volume is new)
CREATE DATABASE jupyterhub OWNER gpubroker;
