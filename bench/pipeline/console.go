// console.go: pepsi-console, pepsi with a browser-like client on its web console: the same
// dispatcher and stage program as pepsi, plus METRICS_LISTEN, and a client that loads the
// console's overview (the page and its style sheet and script) every second while the system
// runs, as a browser tab left open on it does. W1 only: its figure beside pepsi's, measured in
// the same run, is the console's cost to the pipeline (issue 21: within 3 %).

package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"time"
)

const consoleSystem = "pepsi-console"

// consoleClient refreshes a console's overview every second until stopped.
type consoleClient struct {
	addr   string
	cancel context.CancelFunc
	wg     sync.WaitGroup
	loads  int // overview loads that answered 200
	errors int
}

// consoleAddr picks the loopback address the dispatcher's HTTP listener takes.
func consoleAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("pick a console port: %w", err)
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

func startConsoleClient(addr string) *consoleClient {
	ctx, cancel := context.WithCancel(context.Background())
	c := &consoleClient{addr: addr, cancel: cancel}
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			for _, path := range []string{"/", "/static/console.css", "/static/console.js"} {
				ok := c.get(ctx, path)
				if path == "/" {
					if ok {
						c.loads++
					} else if ctx.Err() == nil {
						c.errors++
					}
				}
			}
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
	return c
}

func (c *consoleClient) get(ctx context.Context, path string) bool {
	req, err := http.NewRequestWithContext(ctx, "GET", "http://"+c.addr+path, nil)
	if err != nil {
		return false
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	io.Copy(io.Discard, resp.Body) // the page is read whole, as a browser would
	return resp.StatusCode == 200
}

// stop ends the client and logs how many overviews it loaded.
func (c *consoleClient) stop() {
	c.cancel()
	c.wg.Wait()
	logf("    console client: %d overview loads, %d failed", c.loads, c.errors)
}
