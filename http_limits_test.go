package main

import (
	"bufio"
	"errors"
	"io"
	"net"
	"net/http"
	"testing"
	"time"
)

// TestHTTPServerTimeouts: the HTTP listener's server (newHTTPServer, with its timeouts scaled
// down) closes a keep-alive connection left idle after its answer, and a request whose body
// comes a byte at a time, rather than keep each one (a goroutine and a descriptor) for as long
// as the client likes: with only the header's timeout, both stayed.
func TestHTTPServerTimeouts(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	bodyRead := make(chan error, 1) // what reading the POST's body ended with
	mux.HandleFunc("POST /", func(w http.ResponseWriter, r *http.Request) {
		_, err := io.ReadAll(r.Body)
		bodyRead <- err
		io.WriteString(w, "read")
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	limits := httpLimits{header: time.Second, read: 2 * time.Second, write: 2 * time.Second, idle: time.Second}
	srv := newHTTPServer(mux, limits)
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })

	// closed reports whether the server closed c within d (a read that returns EOF or a reset).
	closed := func(c net.Conn, d time.Duration) bool {
		c.SetReadDeadline(time.Now().Add(d))
		_, err := c.Read(make([]byte, 1))
		var ne net.Error
		return err != nil && !(errors.As(err, &ne) && ne.Timeout())
	}

	// dial connects to the server and sends head, a request's line and headers.
	dial := func(t *testing.T, head string) net.Conn {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		io.WriteString(c, head)
		return c
	}

	t.Run("idle keep-alive", func(t *testing.T) {
		c := dial(t, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatal(err)
		}
		io.ReadAll(resp.Body)
		if resp.Close {
			t.Fatalf("the server did not keep the connection alive")
		}
		start := time.Now()
		if !closed(c, limits.idle+5*time.Second) {
			t.Fatalf("an idle keep-alive connection was still open %v after its answer", time.Since(start))
		}
		if took := time.Since(start); took < limits.idle/2 {
			t.Errorf("closed after %v, before the idle timeout (%v)", took, limits.idle)
		}
	})

	t.Run("slow body", func(t *testing.T) {
		c := dial(t, "POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: 1000\r\n\r\n")
		start := time.Now()
		done := make(chan struct{})
		go func() { // a byte every 100 ms: the body would take 100 s
			defer close(done)
			for range 1000 {
				if _, err := c.Write([]byte("a")); err != nil {
					return
				}
				time.Sleep(100 * time.Millisecond)
			}
		}()
		select {
		case err := <-bodyRead:
			if err == nil {
				t.Errorf("the body that came a byte at a time was read whole")
			}
		case <-time.After(limits.read + 5*time.Second):
			t.Fatalf("a request whose body came a byte at a time was still read %v later", time.Since(start))
		}
		<-done // the server closed the connection: the client's writes fail
		if took := time.Since(start); took > limits.read+5*time.Second {
			t.Errorf("the connection of a request whose body came a byte at a time was kept %v", took)
		}
	})
}
