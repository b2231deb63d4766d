"""Bootstrap: rendezvous through torch stores, metadata exchange, host topology."""

from .base import Bootstrap
from .rendezvous import Rendezvous, resolve
from .store import StoreBootstrap
from .topology import HostInfo, Topology, local_host_info

__all__ = ["Bootstrap", "StoreBootstrap", "Rendezvous", "resolve", "HostInfo", "Topology", "local_host_info"]
