// Command etcd is etcd's server, built from the etcd module that the pinned Kubernetes release
// itself requires (go.etcd.io/etcd/server/v3), so that the control plane is one module graph.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
