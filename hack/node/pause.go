// The pod sandbox process ("pause"): PID 1 of every pod on the test node. It holds the pod's
// namespaces, reaps orphaned children and exits on SIGTERM or SIGINT. Built by
// hack/build-testbin.sh, packed as localhost/pause:grpo by hack/images.sh.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 16)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			if pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil); pid <= 0 || err != nil {
				break
			}
		}
	}
}
