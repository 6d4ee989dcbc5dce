-- pgq compatibility, part 5: consumers.

-- pgq.register_consumer_at(queue, consumer, tick) -> 1 registered now, 0 registered already.
-- A null tick means the queue's last one.  An existing registration given a tick moves there,
-- dropping its open batch.
create or replace function pgq.register_consumer_at(x_queue_name text, x_consumer_name text, x_tick_pos bigint)
returns int4
language plpgsql security definer set search_path = pg_catalog as $$
declare
    v_queue int4;
    v_co int4;
    v_tick int8 := x_tick_pos;
begin
    select queue_id into v_queue from pgcascade.queue where queue_name = x_queue_name;
    if not found then
        raise exception 'Event queue not created yet';
    end if;
    select co_id into v_co from pgcascade.consumer where co_name = x_consumer_name for update;
    if not found then
        insert into pgcascade.consumer (co_name) values (x_consumer_name) returning co_id into v_co;
    end if;
    if v_tick is not null then
        perform 1 from pgcascade.tick where tick_queue = v_queue and tick_id = v_tick;
        if not found then
            raise exception 'cannot reposition, tick not found: %', v_tick;
        end if;
    end if;
    perform 1 from pgcascade.subscription where sub_queue = v_queue and sub_consumer = v_co;
    if found then
        if v_tick is not null then
            perform pgcascade.set_consumer_position(x_queue_name, x_consumer_name, v_tick);
        end if;
        return 0;
    end if;
    if v_tick is null then
        select max(tick_id) into v_tick from pgcascade.tick where tick_queue = v_queue;
        if v_tick is null then
            raise exception 'No ticks for this queue.  Please run ticker on database.';
        end if;
    end if;
    insert into pgcascade.subscription (sub_queue, sub_consumer, sub_last_tick) values (v_queue, v_co, v_tick);
    return 1;
end $$;

create or replace function pgq.register_consumer(x_queue_name text, x_consumer_id text) returns int4
language sql as $$ select pgq.register_consumer_at(x_queue_name, x_consumer_id, null) $$;

-- pgq.unregister_consumer(queue, consumer) -> 1, or 0 when it was not registered.  Its retry
-- events go with it, and the consumer's name once no queue has it.
create or replace function pgq.unregister_consumer(x_queue_name text, x_consumer_name text) returns int4
language plpgsql security definer set search_path = pg_catalog as $$
declare
    v_co int4;
begin
    select c.co_id into v_co
      from pgcascade.subscription s
      join pgcascade.consumer c on c.co_id = s.sub_consumer
      join pgcascade.queue q on q.queue_id = s.sub_queue
     where q.queue_name = x_queue_name and c.co_name = x_consumer_name
       for update of s;
    if not found then
        return 0;
    end if;
    perform pgcascade.unregister_consumer(x_queue_name, x_consumer_name);
    delete from pgcascade.consumer c
     where c.co_id = v_co and not exists (select 1 from pgcascade.subscription s where s.sub_consumer = v_co);
    return 1;
end $$;
