package dsnsecret

import (
	"errors"
	"fmt"
	"net/url"
	"strings"

	"github.com/lib/pq"
)

// Check parses dsn with the driver's own parser (lib/pq's, which every connection of pepsi's
// programs uses, and the key=value syntax of libpq), so that a mistake in it is reported as
// the operator's configuration error, against the DSN as written, and not as a connect-time
// failure blamed on the application_name a program appends, or a wait for a database that no
// retry can reach. The message never quotes the DSN: it may hold a password.
func Check(dsn string) error {
	_, err := pq.NewConnector(dsn)
	if err == nil {
		return nil
	}
	var ue *url.Error
	if errors.As(err, &ue) {
		// url.Error's text repeats the whole URL, password and all: keep only the reason.
		err = fmt.Errorf("not a valid postgres:// URL: %w", ue.Err)
	}
	msg := strings.TrimPrefix(err.Error(), "pq: ")
	if strings.Contains(msg, "$PG") {
		msg += " (in the environment, which lib/pq reads as libpq does)"
	}
	return errors.New(Redact(msg, Secrets(dsn)))
}
