"""The control plane: jobs, placement and freeze/thaw orchestration across node agents.

Imported as `snapshotter.coordinator` (`snapshotter/coordinator` links to this folder): the
folder stays at the top level so the tree shows the control plane beside the node-side
package, while nothing installs a bare top-level `coordinator` module. A package-dir mapping
would do the same for pip, but type checkers cannot follow it.
"""
