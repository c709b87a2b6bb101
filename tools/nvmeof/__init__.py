"""NVMe over Fabrics for kvtier: export a storage node's devices through the kernel NVMe
target (nvmet) and attach them on inference hosts, for direct reads of sealed regions.

- :mod:`.export_plan`  the nvmet configfs operations of an export and of its removal (pure)
- :mod:`.configfs`     applies them to configfs (or a directory laid out like it), reads state
- :mod:`.connect_plan` the client's ``nvme connect`` and read-only commands, the device map (pure)
- :mod:`.host_devices` the client's sysfs view of attached namespaces, waiting for them
- :mod:`.cli`          ``kvtier nvmeof export | unexport | connect``

Real-host steps: docs/operations.md, "NVMe-oF export".
"""
