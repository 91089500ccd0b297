// floor.go: the floor of the churn case, a server with nothing in it.
//
// It answers ACQ4ME with LOCKED and RELEASE with RELEASED and keeps no table: one goroutine
// per connection, GOMAXPROCS 1, pinned like the two servers. What it reaches with the same
// generator is what the kernel, the Go runtime and the generator give on this machine; a
// server's tail at or near the floor's is not the server's own.

package main

import (
	"bufio"
	"bytes"
	"fmt"
	"net"
	"os"
	"runtime"
	"strconv"
)

// floorEnv makes this program the floor server, listening on the address it holds.
const floorEnv = "PC_BENCH_FLOOR"

// serveFloor runs the floor server until it is killed.
func serveFloor(addr string) int {
	runtime.GOMAXPROCS(1)
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "floor listen:", err)
		return 1
	}
	for {
		c, err := ln.Accept()
		if err != nil {
			fmt.Fprintln(os.Stderr, "floor accept:", err)
			return 1
		}
		go floorConn(c)
	}
}

func floorConn(c net.Conn) {
	defer c.Close()
	r := bufio.NewReaderSize(c, 256)
	for {
		line, err := r.ReadSlice('\n')
		if err != nil {
			return
		}
		var reply string
		switch {
		case bytes.HasPrefix(line, []byte("ACQ4ME ")):
			reply = "LOCKED\n"
		case bytes.HasPrefix(line, []byte("RELEASE")):
			reply = "RELEASED\n"
		case bytes.HasPrefix(line, []byte("STATS UPTIME")):
			reply = "uptime: 0 days, 0h 0m 0s\n"
		default:
			reply = "ERROR BAD_COMMAND\n"
		}
		if _, err := c.Write([]byte(reply)); err != nil {
			return
		}
	}
}

// startFloor runs this program as the floor server on a free port, pinned to cpus.
func startFloor(cpus string) (*server, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	cmd := pinned(cpus, self)
	cmd.Env = append(os.Environ(), floorEnv+"="+addr)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start the floor server: %w", err)
	}
	s := &server{name: "floor", addr: addr, cmd: cmd}
	if err := waitListening(addr); err != nil {
		s.stop() //nolint:errcheck // already failing
		return nil, err
	}
	return s, nil
}
