-- pgcascade.delayed_tick(queue, after_tick, delay) -> where a delayed consumer's next batch may end
-- (PgQ's next_batch_custom min_lag, as a cap the consumer passes to next_batch_custom):
--   tick_id    the newest tick after `after_tick` that is at least `delay` old (null: none is),
--              taken before any younger one, so the batch ends at a point in time of the queue
--   next_due   how long until the first younger tick is `delay` old (null: no such tick yet):
--              the consumer sleeps that long instead of waking at every tick
-- Reads the ticks that are due, and one more: cheap however long the delay.  Times are the
-- queue's tick times (a branch's ticks carry the root's), against this server's clock.
create or replace function pgcascade.delayed_tick(
    i_queue_name text, i_after_tick int8, i_delay interval, out tick_id int8, out next_due interval)
language plpgsql stable as $$
declare
    q pgcascade.queue;
    v_young int8;
    v_young_time timestamptz;
begin
    q := pgcascade.find_queue(i_queue_name);
    select t.tick_id, t.tick_time into v_young, v_young_time from pgcascade.tick t
     where t.tick_queue = q.queue_id and t.tick_id > i_after_tick and t.tick_time > now() - i_delay
     order by t.tick_id limit 1;
    select t.tick_id into tick_id from pgcascade.tick t
     where t.tick_queue = q.queue_id and t.tick_id > i_after_tick and t.tick_id < coalesce(v_young, 9223372036854775807)
     order by t.tick_id desc limit 1;
    next_due := greatest(v_young_time + i_delay - now(), interval '0');
end $$;
