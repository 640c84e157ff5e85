# frozen_string_literal: true

# The fake LLM API of bench/jobs.rb (served by `neverblock serve -w 0`): GET
# /wait?seconds=S answers a short JSON completion after S seconds, any number
# at once; GET /most answers the most requests it held at once and resets
# that (a limit across job processes is checked here, at the upstream).
serving = 0
most = 0
run lambda { |env|
  return [200, { "content-type" => "text/plain" }, ["#{most.tap { most = serving }}\n"]] if env["PATH_INFO"] == "/most"
  return [200, { "content-type" => "text/plain" }, ["ok\n"]] unless env["PATH_INFO"] == "/wait"

  most = [most, serving += 1].max
  begin
    sleep(Float(env["QUERY_STRING"][/seconds=([\d.]+)/, 1] || 0))
  ensure
    serving -= 1
  end
  body = %({"choices":[{"message":{"role":"assistant","content":"ok"}}]}\n)
  [200, { "content-type" => "application/json", "content-length" => body.bytesize.to_s }, [body]]
}
