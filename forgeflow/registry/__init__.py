"""Images and registries: image references (``imageref``), credentials (``auth``), skopeo
(``skopeo``), the loopback registry server (``server``), migration between registries
(``migration``), the shard layout (``layout``), base/environment/task images (``images``) and the
pinned projects they are built from (``projects``)."""
