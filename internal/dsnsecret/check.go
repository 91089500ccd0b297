package dsnsecret

import (
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"slices"
	"strings"

	"github.com/lib/pq"
)

// Check parses dsn with the driver's own parser (lib/pq's, which every connection of pepsi's
// programs uses, and the key=value syntax of libpq), so that a mistake in it is reported as
// the operator's configuration error, against the DSN as written, and not as a connect-time
// failure blamed on the application_name a program appends, or a wait for a database that no
// retry can reach. The message never quotes the DSN: it may hold a password.
func Check(dsn string) error {
	// pepsi.conf takes a value as written, quotes included, and a shell has taken its quotes
	// off PEPSI_DSN already: a DSN in quotes is quoted by mistake. lib/pq would read the quote
	// into the first key, `"host`, and send that to the server as a setting while it connects
	// to the default host, or would not see a URL as one.
	if strings.HasPrefix(dsn, `"`) || strings.HasPrefix(dsn, "'") {
		return errors.New("starts with a quote, which is taken as part of the value: remove the quotes")
	}
	cfg, err := pq.NewConfig(dsn) // what pq.NewConnector parses; it refuses nothing more
	if err == nil {
		// lib/pq sends a key it does not know to the server as a setting (statement_timeout=0
		// is one); a key that cannot be a setting's name is a typo the server would refuse at
		// every connect.
		var bad []string
		for k := range cfg.Runtime {
			if !settingNameRe.MatchString(k) {
				bad = append(bad, k)
			}
		}
		if len(bad) == 0 {
			return nil
		}
		slices.Sort(bad)
		err = fmt.Errorf("%q is neither a connection keyword nor a setting's name", bad[0])
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

// settingNameRe is the syntax of a PostgreSQL setting's name (a custom one has a dot:
// guc.c's valid_custom_variable_name).
var settingNameRe = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_$]*(\.[A-Za-z_][A-Za-z0-9_$]*)*$`)

// Settings returns the keys of dsn that lib/pq sends to the server as session settings
// (search_path=mail, statement_timeout=0), sorted: libpq refuses every one of them ("invalid
// connection option"), so a DSN that works for a Go program fails in psql and psycopg, where
// options='-c search_path=mail' works in both. Nil for a DSN that does not parse.
func Settings(dsn string) []string {
	cfg, err := pq.NewConfig(dsn)
	if err != nil {
		return nil
	}
	var keys []string
	for k := range cfg.Runtime {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
