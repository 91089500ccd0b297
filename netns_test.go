// netns_test.go: a machine that vanishes, made to happen. A network namespace holds the
// processes under test; each server they talk to is reached through a veth link of its own,
// and setting that link's far end down makes the server vanish for them the way a machine
// that lost its power or its network does: no FIN, no RST, packets unanswered. A server that
// stops (pg_ctl stop, a crash) closes its sockets, which the other tests cover; this is the
// case where nothing is said at all.

package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
)

// testNetns is a network namespace with one veth link per server: link i joins the host's
// address hostAddr[i] to the namespace's nsAddr[i].
type testNetns struct {
	t        testing.TB
	name     string
	hostIf   []string
	hostAddr []string
	nsAddr   []string
}

var netnsSeq atomic.Int32

// newTestNetns makes a namespace with links veth links, removed when t ends. It needs root
// and the ip command; without them the test is skipped, except under CI, which has both
// (.ci/run runs as root), where a skip would hide the test.
func newTestNetns(t testing.TB, links int) *testNetns {
	t.Helper()
	ip, err := exec.LookPath("ip")
	if err == nil && os.Geteuid() != 0 {
		err = fmt.Errorf("not root")
	}
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("a network namespace needs root and the ip command (iproute2): %v", err)
		}
		t.Skipf("a network namespace needs root and the ip command: %v", err)
	}
	// Names and addresses unique per process and per namespace: the pid's low 14 bits in the
	// addresses' last two octets, a sequence number in the names and the second octet.
	pid := os.Getpid()
	seq := int(netnsSeq.Add(1))
	n := &testNetns{t: t, name: fmt.Sprintf("pepsi-test-%d-%d", pid, seq)}
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(ip, args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	run("netns", "add", n.name)
	t.Cleanup(func() {
		for _, h := range n.hostIf {
			exec.Command(ip, "link", "del", h).Run() // the peer in the namespace goes with it
		}
		exec.Command(ip, "netns", "del", n.name).Run()
	})
	run("-n", n.name, "link", "set", "lo", "up")
	for i := range links {
		// Interface names are at most 15 bytes: "pt" + 5 digits + seq + h/n + link.
		hostIf := fmt.Sprintf("pt%05d%dh%d", pid%100000, seq%10, i)
		nsIf := fmt.Sprintf("pt%05d%dn%d", pid%100000, seq%10, i)
		// A /30 per link: 10.(100 + link's number).(pid bits 6-13).(pid bits 0-5, ×4) + 1, 2.
		subnet := fmt.Sprintf("10.%d.%d.", 100+(seq*8+i)%150, (pid>>6)&0xff)
		base := (pid & 0x3f) << 2
		host, ns := fmt.Sprintf("%s%d", subnet, base+1), fmt.Sprintf("%s%d", subnet, base+2)
		run("link", "add", hostIf, "type", "veth", "peer", "name", nsIf)
		n.hostIf = append(n.hostIf, hostIf)
		run("link", "set", nsIf, "netns", n.name)
		run("addr", "add", host+"/30", "dev", hostIf)
		run("link", "set", hostIf, "up")
		run("-n", n.name, "addr", "add", ns+"/30", "dev", nsIf)
		run("-n", n.name, "link", "set", nsIf, "up")
		// The host's address resolved for good: once the link is cut, what the namespace sends
		// there goes out and is lost, as beyond a router, rather than failing at once for want
		// of an ARP answer ("no route to host"), as on a LAN whose cache has expired.
		mac, err := os.ReadFile(filepath.Join("/sys/class/net", hostIf, "address"))
		if err != nil {
			t.Fatal(err)
		}
		run("-n", n.name, "neigh", "replace", host, "lladdr", strings.TrimSpace(string(mac)), "dev", nsIf, "nud", "permanent")
		n.hostAddr, n.nsAddr = append(n.hostAddr, host), append(n.nsAddr, ns)
	}
	return n
}

// cut makes the host's end of link i vanish for the namespace: its end goes down, and what
// the namespace sends on the link is dropped unanswered.
func (n *testNetns) cut(i int) {
	n.t.Helper()
	if out, err := exec.Command("ip", "link", "set", n.hostIf[i], "down").CombinedOutput(); err != nil {
		n.t.Fatalf("ip link set %s down: %v\n%s", n.hostIf[i], err, out)
	}
}

// heal brings the host's end of link i back: what the namespace sends is answered again.
func (n *testNetns) heal(i int) {
	n.t.Helper()
	if out, err := exec.Command("ip", "link", "set", n.hostIf[i], "up").CombinedOutput(); err != nil {
		n.t.Fatalf("ip link set %s up: %v\n%s", n.hostIf[i], err, out)
	}
}

// wrap returns argv run inside the namespace (ip netns exec: the same process, moved).
func (n *testNetns) wrap(argv ...string) []string {
	return append([]string{"ip", "netns", "exec", n.name}, argv...)
}

// serveOn makes the cluster in dir of pg-private listen on addrs too and take connections from
// peers, and restarts it.
func serveOn(t testing.TB, script, dir string, addrs, peers []string) {
	t.Helper()
	appendTo := func(file, line string) {
		f, err := os.OpenFile(filepath.Join(dir, "data", file), os.O_APPEND|os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if _, err := f.WriteString(line + "\n"); err != nil {
			t.Fatal(err)
		}
	}
	appendTo("postgresql.conf", fmt.Sprintf("listen_addresses = '127.0.0.1,%s'", strings.Join(addrs, ",")))
	for _, peer := range peers {
		appendTo("pg_hba.conf", fmt.Sprintf("host all all %s/32 trust", peer))
	}
	if out, err := exec.Command(script, "restart", dir).CombinedOutput(); err != nil {
		t.Fatalf("pg-private restart %s: %v\n%s", dir, err, out)
	}
}
