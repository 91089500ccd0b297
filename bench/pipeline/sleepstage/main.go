// Command sleepstage is the controls benchmark's stage program (workloads_controls.go): it
// records when its handler first saw the message (state.t0, Unix nanoseconds, written in the
// outcome's own UPDATE), works BENCH_SLEEP_US microseconds, and finishes the message.
package main

import (
	"context"
	"os"
	"strconv"
	"time"

	"pepsi-dispatch/stage"
)

func main() {
	us, _ := strconv.Atoi(os.Getenv("BENCH_SLEEP_US"))
	work := time.Duration(us) * time.Microsecond
	stage.Run(func(_ context.Context, m *stage.Message) error {
		if m.State == nil {
			m.State = map[string]any{}
		}
		m.State["t0"] = time.Now().UnixNano()
		time.Sleep(work)
		return m.Done()
	})
}
